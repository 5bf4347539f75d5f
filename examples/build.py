"""Writes the example scenarios (``examples/*.jsonl``) and their configuration.

Run ``python examples/build.py`` after changing a scenario in ``streams/scenarios.py``; a
test checks the committed files are what this script writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402

from streams.scenarios import EXAMPLE_CONFIG, SCENARIOS  # noqa: E402

HERE = Path(__file__).resolve().parent


def render_config() -> str:
    return "# The example AZ: two GPU classes, one operator.\n" + yaml.safe_dump(EXAMPLE_CONFIG, sort_keys=False)


def main() -> None:
    (HERE / "config.yaml").write_text(render_config())
    for name, build in SCENARIOS.items():
        (HERE / f"{name}.jsonl").write_text("\n".join(build().jsonl()) + "\n")


if __name__ == "__main__":
    main()
