"""The policy the rules obey: the AZ, its GPU classes, who may drain, the GPU-VM policies.

This is the part of the configuration file (docs/contracts.md) that decisions depend on; the
shell's settings (``streams/common/settings.py``) add Kafka and runtime options around it and
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
    enforce: Literal["patch", "notify", "off"] = Field(
        default="patch",
        description="A GPU VM observed without the GPU rules (created with kubectl or by GitOps): patch: "
                    "vmstream applies them, as for a set_gpu intent, and tells the owner; notify: the owner "
                    "is told what is missing, nothing is changed; off: nothing.")
    instancetype_overcommit: Literal["warn", "refuse"] = Field(
        default="warn",
        description="A GPU on a VM with an instance type, where the KubeVirt CR's memoryOvercommit is over "
                    "100 (its memory cannot be pinned by vmstream): warn: the owner and the audit are told; "
                    "refuse: set_gpu is refused.")


class IntentPolicy(Frozen):
    dedup_window_seconds: int = Field(
        default=7 * 86_400, ge=1,
        description="How long an intent id is remembered once decided: redelivered within it, the intent is a "
                    "duplicate (its first decision stands); past it, the id is forgotten, so the table of "
                    "decided ids does not grow for ever. Longer than any redelivery (a producer's retries, "
                    "a replay of the intents topic).")


class LabelKeys(Frozen):
    project: str = "superphenix.net/projectID"


class Limits(Frozen):
    """What one message may weigh: inputs are bounded before they are parsed, outputs so that
    the broker takes them (docs/worker.md, "Bad input")."""

    max_input_bytes: int = Field(
        default=512 * 1024, ge=1024, le=1_000_000,
        description="An intent or watch event larger than this is dead-lettered unparsed (well under the "
                    "broker's 1 MB message limit).")
    max_output_bytes: int = Field(
        default=900_000, ge=65_536, le=1_000_000,
        description="A decision whose message (key and value) would be larger is dead-lettered instead; "
                    "below the producer's 1,000,000-byte request limit and the broker's message limit.")


class AuthPolicy(Frozen):
    """How an intent proves who asks (docs/auth.md)."""

    mode: Literal["jwt", "none"] = Field(
        default="jwt",
        description="jwt: every intent carries a signed credential (the default); none: the body is "
                    "taken at its word, for local development only.",
    )
    jwks_file: str | None = Field(default=None, description="A JWKS file of the signers' public keys "
                                  "(read by the shell; re-read when it changes).")
    jwks_url: str | None = Field(default=None, description="A JWKS URL, fetched and cached by the shell.")
    jwks_refresh_seconds: float = Field(default=300.0, gt=0, description="How long a fetched JWKS is kept.")
    audience: str = Field(default="vmstream", min_length=1, description="The aud claim credentials must carry.")
    issuers: list[str] = Field(default_factory=list, description="Accepted iss claims; empty: any signer of the key set.")
    operator_role: str = Field(default="vmstream-operator", min_length=1,
                               description="The roles claim value that makes a principal an operator.")
    max_lifetime_seconds: int = Field(default=3600, ge=1, description="At most exp - iat.")
    leeway_seconds: int = Field(default=60, ge=0, description="Clock skew allowed around exp, nbf and iat.")
    rejections_to: list[str] = Field(
        default_factory=list,
        description="Who is told of intents whose credential is missing or invalid (their requested_by "
                    "is unproven, so it is never told); empty: only the audit stream and the log.",
    )


class NamespacePolicy(Frozen):
    """Which namespaces belong to which project: ``create_vm`` goes only into its own."""

    template: str | None = Field(
        default=None, description="A project's namespace from its id, e.g. 'spx-{project}'.")
    projects: dict[str, str] = Field(default_factory=dict, description="namespace → project, configured.")
    system: list[str] = Field(
        default_factory=lambda: ["default", "vmstream"],
        description="Namespaces no intent may create in (kube-* always), vmstream's own among them.")

    @field_validator("template")
    @classmethod
    def _names_the_project(cls, value: str | None) -> str | None:
        if value is not None and value.count("{project}") != 1:
            raise ValueError("must contain '{project}' once")
        return value


def lower_case_class_ids(value: object) -> object:
    """Class ids are case-insensitive: they are kept lower-cased. Two ids that differ only in
    case are refused: one class would silently replace the other."""
    if not isinstance(value, dict):
        return value
    given: dict[str, str] = {}  # lower-cased id → the id as written
    lowered: dict[str, object] = {}
    for key, entry in value.items():
        class_id = str(key).lower()
        if class_id in given:
            raise ValueError(f"class ids {given[class_id]!r} and {str(key)!r} differ only in case "
                             "(class ids are case-insensitive): keep one of them")
        given[class_id] = str(key)
        lowered[class_id] = entry
    return lowered


class Config(Frozen):
    az: str = Field(min_length=1)
    gpu_classes: dict[str, GPUClassConfig] = Field(default_factory=dict)
    operators: list[str] = Field(default_factory=list, description="Told of drains nobody asked for; who may "
                                 "drain under auth: none only (with jwt, the credential's operator role).")
    drain: DrainPolicy = DrainPolicy()
    intents: IntentPolicy = IntentPolicy()
    gpu_vm: GPUVMPolicy = GPUVMPolicy()
    labels: LabelKeys = LabelKeys()
    limits: Limits = Limits()
    auth: AuthPolicy = AuthPolicy()
    namespaces: NamespacePolicy = NamespacePolicy()

    @field_validator("gpu_classes", mode="before")
    @classmethod
    def _lower_case_ids(cls, value: object) -> object:
        return lower_case_class_ids(value)

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
