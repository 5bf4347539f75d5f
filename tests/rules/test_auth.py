"""Who asks is proven, not claimed: intents' credentials (handlers/rules/auth.py) and what the
rules let a proven requester do (their projects' VMs and namespaces, drains for operators)."""

from __future__ import annotations

import base64
from datetime import timedelta
from typing import Any

import jwt
import pytest

from handlers.contracts import ids
from handlers.contracts.config import AuthPolicy
from handlers.contracts.messages import principal_problem
from handlers.core.outcomes import Unproven
from handlers.decide.engine import Result
from handlers.rules.auth import KeySet, Principal, Unauthenticated, body_digest, verify_intent
from samples.cluster import RTX, node, vm, vmi
from streams.common.credentials import SigningKey, jwks, sign_intent, signed
from tests.support.harness import INTENTS_TOPIC, KEYS, SIGNER, START, Harness, config

ALICE, BOB, OPS = "alice@example.com", "bob@example.com", "ops@example.com"
GPU = "nvidia-rtx-pro-6000-bse"
POLICY = AuthPolicy()
BODY: dict[str, Any] = {"intent_id": "it-1", "type": "set_gpu", "requested_by": BOB, "project": "proj-b",
                        "spec": {"namespace": "spx-proj-b", "name": "dev-1", "gpu_class": GPU}}


def create_spec(namespace: str, **override: Any) -> dict[str, Any]:
    return {"namespace": namespace, "name": "new-1", "cores": 4, "memory_gib": 8,
            "image": "registry.example.com/ubuntu:24.04", **override}


def az() -> Harness:
    return Harness().observe_all(
        node("gpu-node-1", gpus={RTX: 2}),
        vm("spx-proj-b", "dev-1", project="proj-b", owner=BOB),
        vmi("spx-proj-b", "dev-1", node_name="gpu-node-1"),
    )


def outcome(result: Result) -> tuple[str, str | None]:
    audit = result.decision.audit
    assert audit is not None
    return audit.outcome, audit.reason


def refused(result: Result, why: str) -> None:
    """Refused for who asks (outcome ``unauthenticated``), with the reason; nothing commanded,
    nothing recorded."""
    got, reason = outcome(result)
    assert got == "unauthenticated" and reason is not None and why in reason, reason
    assert reason.startswith("unauthenticated: ")
    assert result.decision.commands == [] and result.decision.changes == []


def verify(token: Any, body: dict[str, Any] = BODY, keys: KeySet = KEYS, now: Any = START,
           policy: AuthPolicy = POLICY) -> Principal | Unauthenticated:
    return verify_intent(token, body, keys, policy, now)


# -------------------------------------------------------------- the credential itself


@pytest.mark.parametrize("algorithm", ["EdDSA", "ES256", "RS256"])
def test_a_credential_proves_its_subject_projects_and_role(algorithm: str) -> None:
    key = SigningKey.generate(f"k-{algorithm}", algorithm)
    token = sign_intent(BODY, key, projects=["proj-b"], roles=["vmstream-operator"], now=START)
    assert verify(token, keys=KeySet.from_jwks(jwks(key))) == Principal(BOB, frozenset({"proj-b"}), True)


def test_without_the_role_no_operator_and_the_body_cannot_add_one() -> None:
    token = sign_intent({**BODY, "roles": ["vmstream-operator"]}, SIGNER, projects=["proj-b"], now=START)
    who = verify(token, {**BODY, "roles": ["vmstream-operator"]})
    assert isinstance(who, Principal) and not who.operator


def test_a_credential_signed_by_another_key_under_a_known_kid_is_refused() -> None:
    impostor = SigningKey.generate(SIGNER.kid)
    who = verify(sign_intent(BODY, impostor, projects=["proj-b"], now=START))
    assert isinstance(who, Unauthenticated) and "Signature verification failed" in who.reason
    assert who.signer is None


def test_an_unknown_kid_is_refused() -> None:
    who = verify(sign_intent(BODY, SigningKey.generate("nobody"), now=START))
    assert who == Unauthenticated("credential: unknown key id 'nobody'")


def test_keys_rotate_by_kid() -> None:
    old, new = SigningKey.generate("2026-10"), SigningKey.generate("2026-11")
    both, after = KeySet.from_jwks(jwks(old, new)), KeySet.from_jwks(jwks(new))
    by_old, by_new = (sign_intent(BODY, key, projects=["proj-b"], now=START) for key in (old, new))
    assert isinstance(verify(by_old, keys=both), Principal) and isinstance(verify(by_new, keys=both), Principal)
    assert isinstance(verify(by_new, keys=after), Principal)
    assert verify(by_old, keys=after) == Unauthenticated("credential: unknown key id '2026-10'")


def test_expiry_is_checked_against_the_inputs_time_not_the_clock() -> None:
    token = sign_intent(BODY, SIGNER, projects=["proj-b"], now=START, lifetime=timedelta(minutes=5))
    # START is in the past of any run: the wall clock would call it expired.
    assert isinstance(verify(token, now=START + timedelta(minutes=5, seconds=59)), Principal)  # leeway 60 s
    late = verify(token, now=START + timedelta(minutes=6, seconds=1))
    assert isinstance(late, Unauthenticated) and late.reason.startswith("credential expired at 2026-11-30 10:05:00")
    early = verify(token, now=START - timedelta(minutes=2))
    assert isinstance(early, Unauthenticated) and early.reason == "credential is not valid yet"


def test_a_credential_cannot_live_longer_than_the_policy_allows() -> None:
    token = sign_intent(BODY, SIGNER, now=START, lifetime=timedelta(days=30))
    who = verify(token)
    assert isinstance(who, Unauthenticated) and "lives longer than 3600 s" in who.reason


def test_a_credential_is_bound_to_its_intent_id_and_body() -> None:
    token = sign_intent(BODY, SIGNER, projects=["proj-b"], now=START)
    other_id = verify(token, {**BODY, "intent_id": "it-2"})
    assert isinstance(other_id, Unauthenticated) and "issued for intent 'it-1', not 'it-2'" in other_id.reason
    other_body = verify(token, {**BODY, "spec": {**BODY["spec"], "name": "prod-1"}})
    assert isinstance(other_body, Unauthenticated) and "intent_sha256 does not match" in other_body.reason
    # The digest is of the canonical body: key order and the credential itself do not count.
    reordered = dict(reversed(list({**BODY, "credential": token}.items())))
    assert body_digest(reordered) == body_digest(BODY) and isinstance(verify(token, reordered), Principal)


@pytest.mark.parametrize(
    ("token", "why"),
    [
        (None, "no credential"),
        (42, "must be a compact JWS string"),
        ("not-a-jws", "not a compact JWS"),
        ("e30.e30.sig.extra", "not a compact JWS"),
        ("!!.e30.c2ln", "not a compact JWS"),
        ("W10.e30.c2ln", "not a compact JWS"),  # a header that is not an object
        # a header nested deeper than a JSON parser goes, within the length limit
        (base64.urlsafe_b64encode(b"[" * 3000 + b"]" * 3000).rstrip(b"=").decode() + ".e30.c2ln", "not a compact JWS"),
        ("e30.e30.c2ln", "algorithm None is not one of"),
        ("x" * 8193, "longer than 8192 characters"),
        (jwt.encode({"sub": BOB}, "s" * 32, algorithm="HS256", headers={"kid": "tests-1"}),
         "algorithm 'HS256' is not one of"),
        (jwt.encode({"sub": BOB}, "", algorithm="none", headers={"kid": "tests-1"}),
         "algorithm 'none' is not one of"),
    ],
)
def test_missing_or_unsigned_credentials_are_refused(token: Any, why: str) -> None:
    who = verify(token)
    assert isinstance(who, Unauthenticated) and why in who.reason


def test_the_audience_must_be_vmstream() -> None:
    who = verify(sign_intent(BODY, SIGNER, audience="billing", now=START))
    assert isinstance(who, Unauthenticated) and "Audience doesn't match" in who.reason


def test_a_key_set_keeps_only_public_signature_keys() -> None:
    private = {**SIGNER.public_jwk(), "kid": "leaked", "d": "AAAA"}
    symmetric = {"kty": "oct", "kid": "mac", "k": "c2VjcmV0"}
    keys = KeySet.from_jwks({"keys": [SIGNER.public_jwk(), private, symmetric]})
    assert list(keys.keys) == ["tests-1"] and len(keys.problems) == 2


# ---------------------------------------------------------------- through the engine


def test_a_signed_intent_is_decided() -> None:
    h = az()
    result = h.intent("set_gpu", BODY["spec"], by=BOB, project="proj-b")
    assert outcome(result) == ("accepted", None) and [c.type for c in result.decision.commands] == ["patch_vm"]


def test_an_unsigned_intent_is_refused_and_its_claimed_requester_not_told() -> None:
    h = az()
    result = h.intent("set_gpu", BODY["spec"], by=BOB, project="proj-b", signer=None)
    refused(result, "no credential")
    assert result.decision.notifications == []


def test_refusals_for_who_asks_go_to_the_configured_address_only() -> None:
    h = Harness(config(auth={"mode": "jwt", "rejections_to": ["security@example.com"]}))
    result = h.intent("set_gpu", BODY["spec"], by=BOB, project="proj-b", signer=None)
    [told] = result.decision.notifications
    assert told.type == "intent_rejected" and told.recipients == ["security@example.com"]


def test_a_forged_requester_is_refused_and_the_signer_told() -> None:
    h = az()
    result = h.intent("drain_node", {"node": "gpu-node-1", "reason": "x"}, by=OPS, project=None,
                      claims={"subject": "mallory@example.com", "roles": []})
    refused(result, "requested_by 'ops@example.com' is not the credential's subject 'mallory@example.com'")
    [told] = result.decision.notifications
    assert told.recipients == ["mallory@example.com"]


def test_a_forged_project_is_refused() -> None:
    h = az()
    result = h.intent("set_gpu", BODY["spec"], by=ALICE, project="proj-b", claims={"projects": ["proj-a"]})
    refused(result, "alice@example.com is not a member of project 'proj-b'")


def test_a_credential_replayed_onto_another_intent_is_refused() -> None:
    h = az()
    original = h.sign({**BODY, "requested_by": BOB})
    stolen = {**original, "intent_id": "it-other", "spec": {**BODY["spec"], "gpu_class": "nvidia-a100"}}
    refused(h.raw_intent(stolen, key="vm/spx-proj-b/dev-1"), "issued for intent 'it-1', not 'it-other'")
    tampered = {**original, "spec": {**BODY["spec"], "gpu_class": "nvidia-a100"}}
    refused(h.raw_intent(tampered, key="vm/spx-proj-b/dev-1"), "intent_sha256 does not match")
    assert outcome(h.raw_intent(original, key="vm/spx-proj-b/dev-1"))[0] == "accepted"


def test_an_expired_credential_is_refused_at_the_inputs_time() -> None:
    h = az()
    body = h.sign({**BODY, "intent_id": "it-late"}, now=START - timedelta(hours=1))
    refused(h.raw_intent(body, key="vm/spx-proj-b/dev-1"), "credential expired at")


def test_a_forgery_does_not_use_up_the_intent_id() -> None:
    h = az()
    refused(h.intent("set_gpu", BODY["spec"], by=BOB, project="proj-b", intent_id="it-9", signer=None),
            "no credential")
    again = h.intent("set_gpu", BODY["spec"], by=BOB, project="proj-b", intent_id="it-9")
    assert outcome(again)[0] == "accepted" and len(again.decision.commands) == 1


def test_forged_copies_of_one_intent_are_audited_apart() -> None:
    h = az()
    first = h.intent("set_gpu", BODY["spec"], by=BOB, project="proj-b", intent_id="it-7", signer=None)
    second = h.intent("set_gpu", {**BODY["spec"], "gpu_class": None}, by=BOB, project="proj-b",
                      intent_id="it-7", signer=None)
    assert first.decision.audit and second.decision.audit
    assert first.decision.audit.audit_id != second.decision.audit.audit_id


def test_an_unsigned_copy_of_a_decided_intent_is_unauthenticated_not_a_duplicate() -> None:
    """A forgery attempt shows in the audit trail as one, apart from the real decision and
    from a harmless repeat; its audit id is one the real intent's sender can tell from its own."""
    h = az()
    real = h.sign({**BODY, "intent_id": "it-real"})
    assert outcome(h.raw_intent(real, key="vm/spx-proj-b/dev-1"))[0] == "accepted"
    for copy in ({k: v for k, v in real.items() if k != "credential"},  # unsigned
                 {**real, "spec": {**BODY["spec"], "gpu_class": None}}):  # the credential on another body
        forged = h.raw_intent(copy, key="vm/spx-proj-b/dev-1")
        refused(forged, "unauthenticated: ")
        audit = forged.decision.audit
        assert audit is not None and audit.input.ref == "it-real" and audit.reason is not None
        assert forged.judgement == Unproven(audit.reason)
        assert audit.audit_id == ids.audit_id(INTENTS_TOPIC, ids.unauthenticated_ref(INTENTS_TOPIC, "it-real", copy),
                                              "unauthenticated")
        assert audit.audit_id != ids.audit_id(INTENTS_TOPIC, ids.unauthenticated_ref(INTENTS_TOPIC, "it-real", real),
                                              "unauthenticated")
    again = h.raw_intent(real, key="vm/spx-proj-b/dev-1")  # the signed intent itself, again
    assert outcome(again)[0] == "duplicate"


def test_a_valid_credential_with_an_invalid_spec_tells_its_subject_why() -> None:
    h = az()
    result = h.intent("set_gpu", {"namespace": "spx-proj-b", "name": "dev-1"}, by=BOB, project="proj-b")
    got, reason = outcome(result)
    assert got == "rejected" and reason is not None and "gpu_class: Field required" in reason
    assert [n.recipients for n in result.decision.notifications] == [[BOB]]


# ------------------------------------------------------------------ operators


def test_the_operator_role_comes_from_the_credential_not_the_config() -> None:
    h = az()
    drain = {"node": "gpu-node-1", "reason": "firmware"}
    listed_only = h.intent("drain_node", drain, by=OPS, project=None, claims={"roles": []})
    assert outcome(listed_only) == ("rejected", "ops@example.com may not drain nodes: only operators may")
    with_role = h.intent("drain_node", drain, by="oncall@example.com", project=None,
                         claims={"roles": ["vmstream-operator"]})
    assert outcome(with_role)[0] == "accepted" and with_role.decision.commands[0].type == "cordon_node"


def test_without_auth_the_configured_operators_are_taken_at_their_word() -> None:
    h = Harness(config(auth={"mode": "none"})).observe_all(node("gpu-node-1", gpus={RTX: 1}))
    result = h.intent("drain_node", {"node": "gpu-node-1", "reason": "r"}, by=OPS, project=None, signer=None)
    assert outcome(result)[0] == "accepted"


# -------------------------------------------------------------- where VMs go


@pytest.mark.parametrize(
    ("namespace", "why"),
    [
        ("spx-proj-b", "namespace spx-proj-b does not belong to project 'proj-a'"),
        ("kube-system", "namespace kube-system is a system namespace"),
        ("kube-public", "namespace kube-public is a system namespace"),
        ("default", "namespace default is a system namespace"),
        ("vmstream", "namespace vmstream is a system namespace"),
        ("team-x", "namespace team-x is not known to belong to a project"),
    ],
)
def test_create_vm_only_into_a_namespace_of_its_project(namespace: str, why: str) -> None:
    h = az()
    result = h.intent("create_vm", create_spec(namespace), by=ALICE, project="proj-a")
    got, reason = outcome(result)
    assert got == "rejected" and reason is not None and reason.startswith(why), reason
    assert result.decision.commands == []


def test_create_vm_into_its_own_projects_namespace() -> None:
    h = az()
    result = h.intent("create_vm", create_spec("spx-proj-a"), by=ALICE, project="proj-a")
    assert outcome(result)[0] == "accepted" and result.decision.commands[0].type == "create_vm"


def test_configured_namespaces_and_system_ones_win_over_the_template() -> None:
    h = Harness(config(namespaces={"template": "spx-{project}", "projects": {"lab-a": "proj-a"},
                                   "system": ["spx-proj-a"]}))
    assert outcome(h.intent("create_vm", create_spec("lab-a")))[0] == "accepted"
    assert outcome(h.intent("create_vm", create_spec("spx-proj-a")))[1] == (
        "namespace spx-proj-a is a system namespace: no VM is created there")


def test_without_a_namespace_policy_no_namespace_is_known() -> None:
    h = Harness(config(namespaces={}))
    assert outcome(h.intent("create_vm", create_spec("spx-proj-a")))[1] == (
        "namespace spx-proj-a is not known to belong to a project")


# ---------------------------------------------------------------- hostile input


@pytest.mark.parametrize("by", ["ops@example.com\x00", "ops@example.com\u202e", "\u202eops@example.com",
                                "ops@ex ample.com", "x" * 257, "ops@example.com\n"])
def test_hostile_principals_are_malformed(by: str) -> None:
    h = az()
    body = {"intent_id": "it-h", "type": "drain_node", "requested_by": by,
            "spec": {"node": "gpu-node-1", "reason": "r"}}
    result = h.raw_intent(signed(body, SIGNER, roles=["vmstream-operator"], now=START), key="node/gpu-node-1", offset=3)
    [letter] = result.dead_letters
    assert "requested_by: Value error, not a principal" in letter.error
    assert result.decision.commands == [] and result.decision.notifications == []


def test_no_whitespace_of_any_kind_names_a_principal() -> None:
    """Every code point Python calls whitespace, in the middle of a name: refused (the check
    looks for the ASCII space only where every other whitespace is unprintable)."""
    spaces = [chr(point) for point in range(0x110000) if chr(point).isspace()]
    assert len(spaces) > 20  # tabs, line breaks, no-break and ideographic spaces, …
    assert all(principal_problem(f"ops{space}x@example.com") for space in spaces)
    assert principal_problem("ops@example.com") is None


@pytest.mark.parametrize("subject", ["ops@example.com\u202e", "ops\x00"])
def test_a_hostile_subject_in_a_valid_credential_is_refused(subject: str) -> None:
    h = az()
    result = h.intent("drain_node", {"node": "gpu-node-1", "reason": "r"}, by=OPS, project=None,
                      claims={"subject": subject})
    refused(result, "sub is not a valid principal")
    assert result.decision.notifications == []


@pytest.mark.parametrize(
    ("labels", "why"),
    [
        ({"team": "a\u202eb"}, "label 'team': a label value is at most 63"),
        ({"team": "x" * 64}, "label 'team': a label value is at most 63"),
        ({"bad key": "a"}, "label 'bad key': a label key's name"),
        ({"a/b/c": "a"}, "label 'a/b/c': a label key is [prefix/]name"),
        ({"Example.COM/team": "a"}, "prefix is a DNS-1123 subdomain"),
        ({"kubevirt.io/vm": "other"}, "label prefix kubevirt.io is reserved"),
        ({"node-role.kubernetes.io/x": "a"}, "label prefix node-role.kubernetes.io is reserved"),
    ],
)
def test_hostile_labels_are_refused(labels: dict[str, str], why: str) -> None:
    h = az()
    result = h.intent("create_vm", create_spec("spx-proj-a", labels=labels), by=ALICE, project="proj-a")
    got, reason = outcome(result)
    assert got == "rejected" and reason is not None and why in reason, reason
    assert result.decision.commands == []


@pytest.mark.parametrize("project", ["proj-b\u202e", "proj b", "-proj", "p" * 64])
def test_hostile_projects_are_refused(project: str) -> None:
    h = az()
    result = h.intent("set_gpu", BODY["spec"], by=BOB, project=project, claims={"projects": [project]})
    got, reason = outcome(result)
    assert got == "rejected" and reason is not None and "project: Value error, a project id is a label value" in reason
    [told] = result.decision.notifications
    assert told.recipients == [BOB] and told.project is None


# ------------------------------------------------------------ the upstream example


def test_the_upstream_example_signs_what_the_worker_accepts() -> None:
    """examples/publish_intent.py uses nothing of vmstream's: its intents must verify."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "publish_intent.py"
    spec = importlib.util.spec_from_file_location("publish_intent", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for algorithm in ("EdDSA", "ES256", "RS256"):
        key = SigningKey.generate("upstream-2026-11", algorithm)
        h = Harness(keys=KeySet.from_jwks(jwks(key))).observe_all(
            vm("spx-proj-b", "dev-1", project="proj-b", owner=BOB), vmi("spx-proj-b", "dev-1", node_name="n"))
        intent = example.set_gpu_intent(by=BOB, project="proj-b", namespace="spx-proj-b", name="dev-1",
                                        gpu_class="nvidia-a100")
        body = example.sign(intent, private_key=key.key, kid=key.kid, projects=["proj-b"], now=START.timestamp())
        assert outcome(h.raw_intent(body, key="vm/spx-proj-b/dev-1")) == ("accepted", None), algorithm


# ------------------------------------------------------------ observed namespaces


def namespace(name: str, project: str | None = None) -> dict[str, Any]:
    labels = {"kubernetes.io/metadata.name": name} | ({"superphenix.net/projectID": project} if project else {})
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def test_an_observed_namespace_belongs_to_the_project_its_label_names() -> None:
    h = az()
    assert outcome(h.observe(namespace("lab-x", "proj-a"))) == ("accepted", None)
    assert outcome(h.intent("create_vm", create_spec("lab-x")))[0] == "accepted"


def test_an_observed_label_wins_over_the_configured_template() -> None:
    h = az().observe_all(namespace("spx-proj-a", "proj-b"), namespace("spx-proj-c"))
    assert outcome(h.intent("create_vm", create_spec("spx-proj-a")))[1] == (
        "namespace spx-proj-a does not belong to project 'proj-a'")
    result = h.intent("create_vm", create_spec("spx-proj-c"), by="carol@example.com", project="proj-c")
    assert outcome(result)[1] == "namespace spx-proj-c is not known to belong to a project"


def test_a_deleted_namespace_is_forgotten_and_system_ones_stay_closed() -> None:
    h = az()
    h.observe(namespace("lab-x", "proj-a"))
    h.observe(namespace("lab-x", "proj-a"), "DELETED")
    assert outcome(h.intent("create_vm", create_spec("lab-x")))[1] == (
        "namespace lab-x is not known to belong to a project")
    h.observe(namespace("kube-system", "proj-a"))  # a label does not open a system namespace
    _, why = outcome(h.intent("create_vm", create_spec("kube-system")))
    assert why is not None and why.startswith("namespace kube-system is a system namespace")
