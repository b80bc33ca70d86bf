"""The Ray Serve application: an ingress and ``replicas`` mmserve replicas behind a request router
(docs/architecture.md, "Replicas on Ray Serve"). ``build_app`` is the application builder that
``mmserve ray serve`` runs and a Serve config file names (``import_path: app.ray_serve.app:build_app``)
for ``serve run`` / ``serve deploy`` on an existing cluster; its ``args`` are ``RayAppArgs``' fields.

Each replica's instance gets the deployment's mmserve settings as ``MMSERVE_*`` environment variables
(so secrets never show in ``ps``), with its own host and port."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr
from pydantic_settings import NoDecode
from ray import serve
from ray.serve.config import RequestRouterConfig

from app.ray_serve.affinity import IMBALANCE_THRESHOLD
from app.ray_serve.ingress import IngressOptions, build_ingress
from app.ray_serve.replica import MmserveReplica
from app.ray_serve.routers import ROUTERS
from app.ray_serve.stream_batching import DEFAULT_INTERVAL_S
from app.settings import Settings

REPLICA_DEPLOYMENT = "MmserveReplica"
INGRESS_DEPLOYMENT = "MmserveIngress"
INSTANCE_OWN_SETTINGS = {"host", "port"}  # each replica's instance has its own
INGRESS_MAX_ONGOING = 4096  # requests the ingress relays at once (each replica bounds its own)


class RayAppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    settings: dict[str, Any] = Field(
        default_factory=dict, description="mmserve serve's settings for every replica, as Settings' fields."
    )
    replicas: int = Field(2, ge=1, description="Replicas, each a whole mmserve instance.")
    router: Literal["media", "default", "prefix"] = Field(
        "media",
        description="media: media affinity; default: Ray's power of two; prefix: Ray's prefix router.",
    )
    imbalance_threshold: int = Field(
        IMBALANCE_THRESHOLD,
        ge=0,
        description="Queue length by which the replica holding the media may exceed the least loaded.",
    )
    replica_cpus: float = Field(1.0, ge=0, description="CPUs each replica reserves.")
    replica_gpus: float = Field(
        0.0, ge=0, description="GPUs each replica reserves (one per replica on GPUs)."
    )
    max_ongoing_requests: int = Field(64, ge=1, description="Requests a replica takes at once.")
    report_keys: int = Field(4096, ge=0, description="Media keys each replica reports (its most recent).")
    stream_interval_ms: float = Field(
        DEFAULT_INTERVAL_S * 1e3,
        ge=0,
        description="A streamed answer's items on Ray's hops, after its first token: at most one per "
        "interval (0: one per chunk).",
    )
    routing_stats_period_s: float = Field(2.0, gt=0, description="How often replicas report.")
    health_check_period_s: float = Field(2.0, gt=0, description="How often Ray checks a replica.")


def instance_env(settings: Settings) -> dict[str, str]:
    """The settings given, as the ``MMSERVE_*`` variables a replica's instance reads: text as it is,
    anything else as JSON, except a list its own validator reads as ``a,b`` (``NoDecode``)."""
    env = {}
    for name in settings.model_fields_set - INSTANCE_OWN_SETTINGS:
        value = getattr(settings, name)
        if value is None:
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if isinstance(value, list) and NoDecode in Settings.model_fields[name].metadata:
            value = ",".join(value)
        env[f"MMSERVE_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


def build_app(args: dict[str, Any]) -> serve.Application:
    parsed = RayAppArgs.model_validate(args)
    settings = Settings(**parsed.settings)
    keys = settings.api_key
    router_config: dict[str, Any] = {
        "request_router_class": ROUTERS[parsed.router],
        "request_router_kwargs": {"imbalance_threshold": parsed.imbalance_threshold}
        if parsed.router == "media"
        else {},
        "request_routing_stats_period_s": parsed.routing_stats_period_s,
    }
    replica = serve.deployment(
        name=REPLICA_DEPLOYMENT,
        num_replicas=parsed.replicas,
        max_ongoing_requests=parsed.max_ongoing_requests,
        health_check_period_s=parsed.health_check_period_s,
        ray_actor_options={
            "num_cpus": parsed.replica_cpus,
            "num_gpus": parsed.replica_gpus,
            "runtime_env": {"env_vars": instance_env(settings)},
        },
        request_router_config=RequestRouterConfig(**router_config),
    )(MmserveReplica)
    ingress_options = IngressOptions(
        api_keys=[keys] if isinstance(keys, str) else list(keys or []),
        max_body_bytes=settings.max_request_body_bytes,
        isolate_tenants=settings.tenant_cache_isolation,
        replica_deployment=REPLICA_DEPLOYMENT,
        chat_messages=parsed.router == "prefix",
        shared_responses=settings.responses_store is not None,
        shutdown_timeout_s=settings.shutdown_timeout,
    )
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0},  # it relays; the replicas hold the CPUs (or GPUs)
    )(build_ingress(ingress_options))
    return ingress.bind(
        replica.bind(report_keys=parsed.report_keys, stream_interval_s=parsed.stream_interval_ms / 1e3)
    )
