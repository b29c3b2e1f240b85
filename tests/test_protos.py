"""Committed gRPC stubs must equal what grpcio-tools generates from the .proto today."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    generated = _load_generator().generate(tmp_path)
    assert {p.name for p in generated} >= {"rollout_pb2.py", "rollout_pb2.pyi", "rollout_pb2_grpc.py"}
    stale = [p.name for p in generated if p.read_text() != (ROOT / "protos" / "rmsft_protos" / p.name).read_text()]
    assert not stale, f"stale generated stubs {stale}: run `make protos` and commit"


def test_contract_has_the_design_rpcs() -> None:
    from rmsft_protos import rollout_pb2

    service = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
    methods = {m.name: m for m in service.methods}
    assert set(methods) >= {"Generate", "UpdateWeights", "GetStatus"}
    assert methods["UpdateWeights"].client_streaming
    assert not methods["Generate"].client_streaming
    chunk = rollout_pb2.WeightChunk.DESCRIPTOR
    assert {f.name for f in chunk.oneofs_by_name["kind"].fields} == {"header", "piece", "trailer"}


def test_health_service_is_available() -> None:
    from grpc_health.v1 import health, health_pb2

    servicer = health.HealthServicer()
    servicer.set("rmsft.v1.RolloutService", health_pb2.HealthCheckResponse.NOT_SERVING)
    reply = servicer.Check(health_pb2.HealthCheckRequest(service="rmsft.v1.RolloutService"), None)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
