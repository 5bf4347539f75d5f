"""How an upstream service asks vmstream for something: build an intent, sign it, publish it.

Only PyJWT (with ``cryptography``) and kafka-python, nothing of vmstream's, so it can be
copied into any service. docs/auth.md explains the credential; in short:

1. the service authenticates the person (its own login, or the identity provider's token)
   and knows their projects and whether they are an operator;
2. it builds the intent, then signs a short-lived JWT about *this* intent with its private
   key, whose public half (under ``kid``) is in the worker's JWKS;
3. it puts the JWT in the intent's ``credential`` field and publishes the intent on
   ``vmstream.intents`` under its key.

    python examples/publish_intent.py --key upstream.pem --kid upstream-2026-11 \\
        --by bob@example.com --project proj-b --namespace spx-proj-b --name dev-1 \\
        --gpu-class nvidia-a100 --bootstrap 127.0.0.1:9092

Without ``--bootstrap`` it prints the signed intent instead of publishing it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
import uuid
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

AUDIENCE = "vmstream"  # the worker's auth.audience
OPERATOR_ROLE = "vmstream-operator"  # the worker's auth.operator_role
LIFETIME_SECONDS = 300  # at most the worker's auth.max_lifetime_seconds


def canonical_digest(intent: dict[str, Any]) -> str:
    """SHA-256 (hex) of the intent without ``credential``: keys sorted, no whitespace, UTF-8."""
    unsigned = {key: value for key, value in intent.items() if key != "credential"}
    text = json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def algorithm_of(private_key: Any) -> str:
    if isinstance(private_key, ed25519.Ed25519PrivateKey):
        return "EdDSA"
    if isinstance(private_key, ec.EllipticCurvePrivateKey):
        return "ES256"  # on P-256
    return "RS256"


def sign(intent: dict[str, Any], *, private_key: Any, kid: str, projects: list[str], operator: bool = False,
         issuer: str | None = None, now: float | None = None) -> dict[str, Any]:
    """The intent with its ``credential``: a JWT bound to its id and body, valid 5 minutes."""
    issued = int(now if now is not None else time.time())
    claims: dict[str, Any] = {
        "sub": intent["requested_by"],  # who asks: the person the service authenticated
        "aud": AUDIENCE,
        "iat": issued,
        "exp": issued + LIFETIME_SECONDS,
        "intent_id": intent["intent_id"],
        "intent_sha256": canonical_digest(intent),
        "projects": projects,  # the projects this person belongs to
        "roles": [OPERATOR_ROLE] if operator else [],
    }
    if issuer:
        claims["iss"] = issuer
    token = jwt.encode(claims, private_key, algorithm=algorithm_of(private_key), headers={"kid": kid})
    return {**intent, "credential": token}


def set_gpu_intent(*, by: str, project: str, namespace: str, name: str, gpu_class: str | None) -> dict[str, Any]:
    return {
        "intent_id": str(uuid.uuid4()),  # a retry reuses it: the same id twice has one effect
        "type": "set_gpu",
        "requested_by": by,
        "project": project,
        "spec": {"namespace": namespace, "name": name, "gpu_class": gpu_class},
    }


def publish(bootstrap: str, intent: dict[str, Any], topic: str = "vmstream.intents") -> None:
    from kafka import KafkaProducer

    spec = intent["spec"]
    key = f"node/{spec['node']}" if "node" in spec else f"vm/{spec['namespace']}/{spec['name']}"
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        # The bytes published are the JSON the digest was computed over, plus the credential.
        producer.send(topic, key=key.encode(), value=json.dumps(intent).encode()).get(timeout=30)
    finally:
        producer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--key", required=True, help="the service's private key (PEM)")
    parser.add_argument("--kid", required=True, help="its key id in the worker's JWKS")
    parser.add_argument("--by", required=True)
    parser.add_argument("--project", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--gpu-class")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers; without it, print the intent")
    args = parser.parse_args()
    private_key = serialization.load_pem_private_key(Path(args.key).read_bytes(), password=None)
    intent = set_gpu_intent(by=args.by, project=args.project, namespace=args.namespace, name=args.name,
                            gpu_class=args.gpu_class)
    signed = sign(intent, private_key=private_key, kid=args.kid, projects=[args.project])
    if args.bootstrap:
        publish(args.bootstrap, signed)
        print(f"published {signed['intent_id']}")
    else:
        print(json.dumps(signed, indent=2))


if __name__ == "__main__":
    main()
