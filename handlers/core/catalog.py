"""The GPU class catalog of one AZ: class ids ↔ device-plugin resources.

Users pick classes, KubeVirt sees devices. A device that maps to no class is reported as
an *undefined* class carrying its raw device name — never an error, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from handlers.contracts.config import Config


@dataclass(frozen=True, slots=True)
class GPUClass:
    id: str | None  # None: an undefined class, known only by its device
    display_name: str
    device_name: str

    @property
    def undefined(self) -> bool:
        return self.id is None

    def describe(self) -> dict[str, object]:
        return {
            "class_id": self.id,
            "display_name": self.display_name,
            "device_name": self.device_name,
            "undefined": self.undefined,
        }


class UnknownGPUClass(LookupError):
    pass


@dataclass(frozen=True, slots=True)
class Catalog:
    by_id: dict[str, GPUClass]
    by_device: dict[str, GPUClass]

    @classmethod
    def from_config(cls, config: Config) -> Catalog:
        by_id = {
            class_id: GPUClass(class_id, entry.display_name or class_id, entry.device_name)
            for class_id, entry in config.gpu_classes.items()
        }
        return cls(by_id, {c.device_name: c for c in by_id.values()})

    @property
    def device_names(self) -> frozenset[str]:
        """The classes' devices: a host device with one of these names is a GPU."""
        return frozenset(self.by_device)

    @property
    def offers_gpus(self) -> bool:
        return bool(self.by_id)

    def lookup(self, class_id: str) -> GPUClass:
        """The class a user named (case-insensitive), or :class:`UnknownGPUClass`."""
        found = self.by_id.get(class_id.lower())
        if found is None:
            if not self.by_id:
                raise UnknownGPUClass(f"this AZ offers no GPU (asked for {class_id!r})")
            known = ", ".join(sorted(self.by_id))
            raise UnknownGPUClass(f"unknown GPU class {class_id!r}; this AZ offers: {known}")
        return found

    def for_device(self, device_name: str) -> GPUClass:
        """The class of a device seen on a VM; an undefined class if none maps to it."""
        return self.by_device.get(device_name) or GPUClass(None, device_name, device_name)
