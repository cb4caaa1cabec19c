"""The stock gRPC services a kvmem server serves beside its own (grpc.health.v1 on the
socket, --tcp and --health-port; reflection on the socket and --tcp): a request body that
does not parse is INVALID_ARGUMENT naming the method and the message type, counted in the
rate-limited refusal summaries, never an UNKNOWN with a traceback in the log; good
requests are answered as before. Real servers, raw gRPC calls."""

from __future__ import annotations

import re

import grpc
import pytest
from conftest import start_server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from test_limits import BAD_BODIES, error_info, no_traceback, refusal_lines
from test_service import free_tcp_port

HEALTH = "/grpc.health.v1.Health/"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
SERVING = health_pb2.HealthCheckResponse.SERVING


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def check_refused(err: grpc.RpcError, method: str, type_name: str, body: bytes) -> None:
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (body, err)
    expected = f"{method}: the request body ({len(body)} bytes) is not a valid {type_name}"
    assert expected in (err.details() or ""), err.details()
    assert error_info(err).reason == "BAD_VALUE"


@pytest.fixture
def served(tmpdir_short: str):
    """A server on its socket, on --tcp and with --health-port; the three targets."""
    tcp, health_port = free_tcp_port(), free_tcp_port()
    srv = start_server(
        tmpdir_short, "--num-pages", "65", "--page-size", "4", "--max-context", "64",
        "--tcp", f"127.0.0.1:{tcp}", "--health-port", str(health_port),
    )  # fmt: skip
    yield srv, {"socket": srv.target, "tcp": f"127.0.0.1:{tcp}", "health-port": f"127.0.0.1:{health_port}"}
    assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("where", ["socket", "tcp", "health-port"])
def test_a_health_body_that_does_not_parse_is_invalid_argument(served, where: str) -> None:
    srv, targets = served
    with grpc.insecure_channel(targets[where]) as channel:
        check = channel.unary_unary(HEALTH + "Check", request_serializer=None, response_deserializer=None)
        watch = channel.unary_stream(HEALTH + "Watch", request_serializer=None, response_deserializer=None)
        for body in BAD_BODIES:  # the last: field 1 (service) is not UTF-8
            err = refused(lambda body=body: check(body, timeout=10))
            check_refused(err, "grpc.health.v1.Health/Check", "grpc.health.v1.HealthCheckRequest", body)
            err = refused(lambda body=body: next(watch(body, timeout=10)))
            check_refused(err, "grpc.health.v1.Health/Watch", "grpc.health.v1.HealthCheckRequest", body)
        stub = health_pb2_grpc.HealthStub(channel)  # good requests: answered as ever
        assert stub.Check(health_pb2.HealthCheckRequest(service="kvmem.v1.KVMemory"), timeout=10).status == SERVING
        watching = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watching).status == SERVING
        watching.cancel()
        unknown = refused(lambda: stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10))
        assert unknown.code() == grpc.StatusCode.NOT_FOUND, unknown
        listed = refused(lambda: stub.List(health_pb2.HealthListRequest(), timeout=10))
        assert listed.code() == grpc.StatusCode.UNIMPLEMENTED, listed
    no_traceback(srv)
    lines = refusal_lines(srv.log())
    assert any("grpc.health.v1.Health/Check" in line and "BAD_VALUE" in line for line in lines), lines


@pytest.mark.parametrize("where", ["socket", "tcp"])
def test_a_reflection_message_that_does_not_parse_ends_the_stream_as_invalid_argument(served, where: str) -> None:
    srv, targets = served
    with grpc.insecure_channel(targets[where]) as channel:
        stream = channel.stream_stream(REFLECTION, request_serializer=None, response_deserializer=None)
        good = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
        for body in BAD_BODIES:
            answers = []
            with pytest.raises(grpc.RpcError) as info:
                for answer in stream(iter([good, body]), timeout=10):
                    answers.append(answer)
            assert len(answers) == 1, answers  # the good message was answered
            check_refused(
                info.value,
                "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                "grpc.reflection.v1alpha.ServerReflectionRequest",
                body,
            )
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        [answer] = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
        names = {service.name for service in answer.list_services_response.service}
        assert names == {"kvmem.v1.KVMemory", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    no_traceback(srv)


def test_a_flood_of_garbage_on_the_health_port_logs_a_bounded_summary(served) -> None:
    """2,000 malformed Checks from one peer: each INVALID_ARGUMENT, and the log holds the
    first-of-its-kind line and summaries, not a line (let alone a traceback) per call."""
    srv, targets = served
    with grpc.insecure_channel(targets["health-port"]) as channel:
        check = channel.unary_unary(HEALTH + "Check", request_serializer=None, response_deserializer=None)
        codes = set()
        for i in range(2000):
            try:
                check(b"\xff\xff\xff" if i % 2 else b"\x08", timeout=10)
            except grpc.RpcError as err:
                codes.add(err.code())
    assert codes == {grpc.StatusCode.INVALID_ARGUMENT}, codes
    assert srv.stop() == 0, srv.log()  # the last summary is flushed at the stop
    no_traceback(srv)
    lines = refusal_lines(srv.log())
    assert 1 <= len(lines) <= 10, lines
    firsts = [line for line in lines if "refused grpc.health.v1.Health/Check from" in line]
    summarised = sum(int(n) for n in re.findall(r"refused (\d+) calls in the last", "\n".join(lines)))
    assert len(firsts) + summarised == 2000, lines  # every refusal counted, in a few lines
