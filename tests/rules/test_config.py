"""The policy's configuration model (handlers/contracts/config.py): what it refuses rather than keep
silently wrong."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from handlers.contracts.config import Config
from handlers.core.catalog import Catalog

A100 = "nvidia.com/GA100_A100_PCIE_40GB"
A100_80 = "nvidia.com/GA100_A100_PCIE_80GB"


def test_class_ids_are_kept_lower_cased_and_looked_up_in_any_case() -> None:
    config = Config(az="az1", gpu_classes={"NVIDIA-A100": {"device_name": A100}})
    assert list(config.gpu_classes) == ["nvidia-a100"]
    assert Catalog.from_config(config).lookup("Nvidia-A100").device_name == A100


def test_two_class_ids_differing_only_in_case_are_refused() -> None:
    with pytest.raises(ValidationError) as caught:
        Config(az="az1", gpu_classes={"NVIDIA-A100": {"device_name": A100}, "nvidia-a100": {"device_name": A100_80}})
    (problem,) = caught.value.errors()
    assert problem["loc"] == ("gpu_classes",)
    assert "'NVIDIA-A100'" in problem["msg"] and "'nvidia-a100'" in problem["msg"]
    assert "differ only in case" in problem["msg"]
