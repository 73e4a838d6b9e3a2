"""The `specmesh` command: its parser, built one subcommand at a time, and the commands that run
the mesh or talk to it (`models`, `datastore` and `heads` are in assets.py). `--help` prints
USAGE.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from specmesh_services.common.config import DEFAULT_GATEWAY_PORT, SettingsError
from specmesh_services.launch import assets
from specmesh_services.launch.flags import add_setting_flags, reference_markdown, settings_from

__all__ = ["build_parser", "main", "settings_from"]

USAGE = """The `specmesh` command.

  specmesh run "Once upon a time"        generate in one process (all roles, in-memory pool)
  specmesh up [--port 50051] [--detach]   start the stack as local processes (+ its own Redis)
  specmesh generate "..." [--stream]      generate through a running stack (gRPC SDK)
  specmesh down                           stop what `up` started
  specmesh models list|prepare            show / convert the installed models
  specmesh datastore build|tune|info      the lookup datastore (SSSD drafting without a model)
  specmesh serve ROLE                     run one service (what `up`, compose and k8s start)
  specmesh health --address HOST:PORT     grpc.health.v1 check of a running service
  specmesh config show|reference          the settings in effect (YAML) / their reference

Settings come from (highest first) flags, SPECMESH_* environment variables, a YAML file
(--config FILE) and the defaults; docs/configuration.md lists them all.
"""

ROLES = ("gateway", "router", "drafter", "verifier", "datastore")


# ---------------------------------------------------------------------------------------------
# flags


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, help="new tokens at most [256]")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy [0]")
    g.add_argument("--top-p", type=float, help="nucleus mass in (0, 1] [1]")
    g.add_argument("--top-k", type=int, default=0, help="0 = off [0]")
    g.add_argument("--seed", type=int, help="same seed, same output")
    g.add_argument("--repetition-penalty", type=float,
                   help="> 0; divides positive (multiplies negative) logits of tokens already in "
                        "prompt + output; > 1 discourages repeats, e.g. 1.2 [1 = off]")
    g.add_argument("--presence-penalty", type=float,
                   help="in [-2, 2]; subtracted once from the logit of each token already "
                        "generated (the prompt does not count) [0 = off]")
    g.add_argument("--frequency-penalty", type=float,
                   help="in [-2, 2]; subtracted from a token's logit per time it was already "
                        "generated (the prompt does not count) [0 = off]")
    g.add_argument("--stop", action="append", help="stop sequence (repeatable)")
    g.add_argument("--chat", action="store_true",
                   help="send the prompt as a user chat message (the model's chat template)")


def _request_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, stop=args.stop,
                  repetition_penalty=args.repetition_penalty,
                  presence_penalty=args.presence_penalty,
                  frequency_penalty=args.frequency_penalty)
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        kwargs["prompt"] = args.prompt
    return kwargs


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def _gpu_list(text: str) -> tuple[int, ...]:
    try:
        gpus = tuple(int(g) for g in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices like 0,1, got '{text}'") from None
    if any(g < 0 for g in gpus):
        raise argparse.ArgumentTypeError(f"GPU indices are >= 0, got '{text}'")
    return gpus


def _client_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security (a gateway with TLS or API keys)")
    g.add_argument("--tls-dir", type=Path, help="a secure stack's folder (`specmesh up --secure` "
                   "prints it): its CA, client certificate and API key")
    g.add_argument("--api-key-file", type=Path, help="a file holding the API key [env "
                   "SPECMESH_API_KEY]")


def _client_security(args: argparse.Namespace):
    """(channel credentials or None, API key or None) from --tls-dir / --api-key-file / the
    SPECMESH_API_KEY variable."""
    import os

    import grpc

    credentials, key = None, os.environ.get("SPECMESH_API_KEY")
    folder = getattr(args, "tls_dir", None)
    if folder is not None:
        credentials = grpc.ssl_channel_credentials((folder / "ca.pem").read_bytes(),
                                                   (folder / "service-key.pem").read_bytes(),
                                                   (folder / "service.pem").read_bytes())
        if (folder / "api_key").is_file():
            key = (folder / "api_key").read_text().strip()
    if getattr(args, "api_key_file", None) is not None:
        key = args.api_key_file.read_text().strip()
    return credentials, key


def _print_stats(stats, finish: str | None) -> None:
    tps = stats.completion_tokens / stats.total_time_s if stats.total_time_s else 0.0
    print(f"\n[{stats.completion_tokens} tokens in {stats.total_time_s:.2f} s ({tps:.1f} tok/s), "
          f"finish={finish}, steps={stats.steps}, drafted={stats.draft_tokens}, "
          f"accepted={stats.accepted_tokens}, mean accepted length="
          f"{stats.mean_accepted_length:.2f}, ttft={stats.time_to_first_token_s:.2f} s]",
          file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# commands


def cmd_run(args: argparse.Namespace) -> int:
    from specmesh_services.common.serving import setup_logging
    from specmesh_services.launch.embedded import EmbeddedMesh
    from specmesh_services.launch.stack import prepare
    from specmesh.types import Stats, finish_reason_name

    settings = settings_from(args)
    # quiet unless a log level was asked for (flag, environment or --config file)
    setup_logging(settings.log_level if "log_level" in settings.model_fields_set else "WARNING")
    prepare(settings)

    async def main() -> None:
        async with EmbeddedMesh.start(settings) as mesh:
            last = None
            async for chunk in mesh.stream(**_request_kwargs(args)):
                print(chunk.text, end="", flush=True)
                last = chunk
            print()
            _print_stats(Stats.from_pb(last.stats), finish_reason_name(last.finish_reason))

    asyncio.run(main())
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from specmesh import Client, SpecmeshError

    kwargs = _request_kwargs(args)
    try:
        credentials, api_key = _client_security(args)
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with Client(args.address, timeout=args.timeout, credentials=credentials,
                api_key=api_key) as client:
        try:
            if args.stream:
                last = None
                stream = (client.stream_chat(kwargs.pop("messages"), **kwargs) if args.chat
                          else client.stream(kwargs.pop("prompt"), **kwargs))
                for chunk in stream:
                    print(chunk.text, end="", flush=True)
                    last = chunk
                print()
                stats, finish = last.stats, last.finish_reason
            else:
                out = (client.chat(kwargs.pop("messages"), **kwargs) if args.chat
                       else client.generate(kwargs.pop("prompt"), **kwargs))
                print(out.text)
                stats, finish = out.stats, out.finish_reason
        except SpecmeshError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    _print_stats(stats, finish)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from specmesh_services.launch import stack

    return stack.up(settings_from(args), port=args.port, detach=args.detach, secure=args.secure,
                    verifiers=args.verifiers, routers=args.routers, drafting=args.drafting,
                    gpus=args.gpus)


def cmd_down(args: argparse.Namespace) -> int:
    from specmesh_services.launch import stack

    return stack.down(settings_from(args))


def cmd_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    credentials, _ = _client_security(args)
    with (grpc.secure_channel(args.address, credentials) if credentials is not None
          else grpc.insecure_channel(args.address)) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"{args.address}: {err.code().name} {err.details() or ''}".strip())
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_config_show(args: argparse.Namespace) -> int:
    import yaml

    print(yaml.safe_dump(settings_from(args).model_dump(mode="json"), sort_keys=False), end="")
    return 0


def cmd_config_reference(args: argparse.Namespace) -> int:
    print(reference_markdown(), end="")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import importlib

    settings = settings_from(args)
    if args.role in ("verifier", "drafter"):  # the roles that hold models: refused at start-up
        from specmesh_services.common.device import check as check_device

        check_device(settings)
    module = {"gateway": "specmesh_gateway.server"}.get(args.role,
                                                       f"specmesh_services.{args.role}.server")
    importlib.import_module(module).main(settings)
    return 0


# ---------------------------------------------------------------------------------------------
# parser: one function per subcommand


def _command(sub, name: str, func, summary: str, description: str | None = None
             ) -> argparse.ArgumentParser:
    """The parser of subcommand `name`, which runs `func`."""
    p = sub.add_parser(name, help=summary, description=description)
    p.set_defaults(func=func)
    return p


def _add_run(sub) -> None:
    p = _command(sub, "run", cmd_run, "generate in one process (embedded mode)",
                 "Generate with every role in this process (in-memory pool): "
                 "prints the text as it is accepted, then the speculation stats.")
    p.add_argument("prompt", help="prompt text (raw, or a user message with --chat)")
    _sampling_flags(p)
    add_setting_flags(p, "run")


def _add_up(sub) -> None:
    p = _command(sub, "up", cmd_up, "start the stack as local processes",
                 "Start gateway (on --port), router, drafter, verifier and a "
                 "private redis-server (unless --redis-url) as local processes. "
                 "Ctrl-C or `specmesh down` stops them all.")
    p.add_argument("--port", type=_port, default=DEFAULT_GATEWAY_PORT,
                   help="gateway port (0: a free one, printed once up) [50051]")
    p.add_argument("--detach", action="store_true", help="return once the stack is up")
    p.add_argument("--verifiers", type=_positive, default=1, metavar="N",
                   help="verifier replicas (they share the pool's trees; a request's KV is "
                        "rebuilt on whichever takes its next step) [1]")
    p.add_argument("--routers", type=_positive, default=1, metavar="N",
                   help="router replicas (the gateway spreads new requests over them; a stream "
                        "whose router dies goes on on another from the request's state in the "
                        "pool) [1]")
    p.add_argument("--drafting", type=_positive, default=1, metavar="N",
                   help="replicas of the drafter and of the datastore (each request drafts on "
                        "one, moving to another when it dies) [1]")
    p.add_argument("--gpus", type=_gpu_list, default=(), metavar="0,1,...",
                   help="GPUs for the model processes: each verifier and drafter replica gets "
                        "the next one (CUDA_VISIBLE_DEVICES, --device cuda), the other roles "
                        "none [every process sees every GPU: one card shared, docs/gpu.md]")
    p.add_argument("--secure", action="store_true",
                   help="TLS (mutual) between all services and on the gateway, an API key on the "
                        "gateway, Redis with a password over TLS: a local CA and the key are made "
                        "once in <run dir>/tls")
    add_setting_flags(p, "up")


def _add_down(sub) -> None:
    p = _command(sub, "down", cmd_down, "stop what `specmesh up` started")
    add_setting_flags(p, "down")


def _add_generate(sub) -> None:
    p = _command(sub, "generate", cmd_generate, "generate through a running stack (gRPC)",
                 "Send one request to a gateway with the client SDK.")
    p.add_argument("prompt", help="prompt text (raw, or a user message with --chat)")
    p.add_argument("--address", default=f"127.0.0.1:{DEFAULT_GATEWAY_PORT}",
                   help="gateway host:port [127.0.0.1:50051]")
    p.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds [600]")
    _sampling_flags(p)
    _client_flags(p)


def _add_health(sub) -> None:
    p = _command(sub, "health", cmd_health, "check a service's grpc.health.v1 status",
                 "Exit 0 if the service at --address answers SERVING "
                 "(for container health checks and scripts).")
    p.add_argument("--address", default=f"127.0.0.1:{DEFAULT_GATEWAY_PORT}", help="host:port")
    p.add_argument("--service", default="", help="service name, e.g. specmesh.v1.Router [all]")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds [3]")
    _client_flags(p)


def _add_serve(sub) -> None:
    p = _command(sub, "serve", cmd_serve, "run one service",
                 "Run one service in the foreground (used by `specmesh up`, "
                 "docker-compose and the Kubernetes manifests).")
    p.add_argument("role", choices=ROLES)
    add_setting_flags(p, "serve")


def _add_config(sub) -> None:
    p = sub.add_parser("config", help="the settings in effect, or the configuration reference",
                       description="show: the settings this command line, the SPECMESH_* "
                                   "environment and --config FILE give, as YAML (a file --config "
                                   "reads). reference: docs/configuration.md, generated from "
                                   "Settings.")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="print the settings in effect as YAML")
    add_setting_flags(show, "config show")
    show.set_defaults(func=cmd_config_show)
    ref = actions.add_parser("reference", help="print the configuration reference (Markdown)")
    ref.set_defaults(func=cmd_config_reference)


def build_parser() -> argparse.ArgumentParser:
    """The `specmesh` parser: its subcommands in the order `--help` lists them."""
    parser = argparse.ArgumentParser(prog="specmesh", description=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_run, _add_up, _add_down, _add_generate, assets.add_models, _add_health,
                _add_serve, assets.add_datastore, assets.add_heads, _add_config):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a setting that does not exist or cannot be parsed, or a model that
    cannot be found, is a one-line error."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SettingsError as err:
        print(f"specmesh: error: {err}", file=sys.stderr)
        return 2
    except LookupError as err:
        # models imports torch: loaded here only once something has raised from it
        from specmesh_services.common.models import ModelNotFound

        if not isinstance(err, ModelNotFound):
            raise
        print(f"specmesh: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
