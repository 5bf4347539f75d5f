"""The wheel ships the license and the PEP 561 markers, under the license pyproject.toml names.

The wheel is built by the build backend itself (setuptools, from the test extras), in a
copy of the sources, without a network: what ``pip install .`` in the image installs.
"""

from __future__ import annotations

import email
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Every package whose code others may import and type-check (the product: [tool.setuptools]).
TOP_LEVEL = ("handlers", "streams")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for package in TOP_LEVEL:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = source / "dist"
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))",
         str(out)],
        cwd=source, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    name = result.stdout.strip().splitlines()[-1]
    return zipfile.ZipFile(out / name)


def test_the_license_is_apache_2_0_everywhere_it_is_named() -> None:
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert re.search(r"^\s*Apache License\s*\n\s*Version 2\.0, January 2004\s*$", text, re.M)
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in dockerfile


@pytest.mark.parametrize("package", TOP_LEVEL)
def test_each_shipped_package_is_marked_typed(package: str) -> None:
    marker = ROOT / package / "py.typed"
    assert marker.is_file() and marker.read_text() == ""


def test_the_wheel_holds_the_markers_and_the_license(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for package in TOP_LEVEL:
        assert f"{package}/py.typed" in names, package
    dist_info = f"vmstream-{PROJECT['version']}.dist-info"
    assert wheel.read(f"{dist_info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    metadata = email.message_from_bytes(wheel.read(f"{dist_info}/METADATA"))
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    # The product only: the harness and the tests stay out.
    assert not [n for n in names if n.startswith(("harness/", "tests/"))]
