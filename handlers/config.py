"""The policy the rules obey: the AZ, its GPU classes, who may drain, the GPU-VM policies.

This is the part of the configuration file (CONTRACTS.md) that decisions depend on; the
shell's settings (``streams/settings.py``) add Kafka and runtime options around it and
hand the handlers this frozen model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GPUClassConfig(Frozen):
    display_name: str | None = None
    device_name: str = Field(min_length=1, description="The device-plugin resource name.")


class DrainPolicy(Frozen):
    notice_seconds: int = Field(default=900, ge=0)


class GPUVMPolicy(Frozen):
    eviction_strategy: Literal["External", "None"] = "External"


class LabelKeys(Frozen):
    project: str = "superphenix.net/projectID"


class Config(Frozen):
    az: str = Field(min_length=1)
    gpu_classes: dict[str, GPUClassConfig] = Field(default_factory=dict)
    operators: list[str] = Field(default_factory=list)
    drain: DrainPolicy = DrainPolicy()
    gpu_vm: GPUVMPolicy = GPUVMPolicy()
    labels: LabelKeys = LabelKeys()

    @field_validator("gpu_classes", mode="before")
    @classmethod
    def _lower_case_ids(cls, value: object) -> object:
        """Class ids are case-insensitive: they are kept lower-cased."""
        if isinstance(value, dict):
            return {str(k).lower(): v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _devices_are_unique(self) -> Config:
        seen: dict[str, str] = {}
        for class_id, cls_ in self.gpu_classes.items():
            if cls_.device_name in seen:
                raise ValueError(
                    f"gpu_classes.{class_id}.device_name: {cls_.device_name} is already "
                    f"the device of class {seen[cls_.device_name]}"
                )
            seen[cls_.device_name] = class_id
        return self
