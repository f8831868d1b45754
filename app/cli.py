"""`ridgeline` command line: serve, generate, plan, bench, export-model.

Flag names follow vLLM, with SGLang's spellings accepted as aliases where they differ.
"""

from __future__ import annotations

import argparse
import sys

from app.bench import serve_args
from app.config import EngineConfig, ServerSettings, setting_fields

_TYPES = {"int": int, "float": float, "str": str}


def add_settings(p: argparse.ArgumentParser, *classes: type, title: str) -> None:
    """One flag per config field: name, type, default, choices and help come from the field."""
    g = p.add_argument_group(title)
    for f, default in setting_fields(*classes):
        meta = f.metadata
        flags = meta["flags"] or ("--" + f.name.replace("_", "-"),)
        kind = str(f.type).replace(" | None", "")
        shown = "" if default is None else f" (default: {default})"
        if kind == "bool":
            action = "store_true" if default is False else argparse.BooleanOptionalAction
            g.add_argument(*flags, dest=f.name, action=action, default=default,
                           help=meta["help"])
            continue
        many = kind.startswith("tuple[")  # a list of values: --lora-modules a=x b=y
        g.add_argument(*flags, dest=f.name, type=_TYPES.get(kind, str), default=default,
                       choices=meta["choices"], help=meta["help"] + shown,
                       nargs="+" if many else None)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_settings(p, EngineConfig, title="engine")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    names = {f.name for f, _ in setting_fields(EngineConfig)}
    return EngineConfig.from_kwargs(**{k: v for k, v in vars(a).items() if k in names})


def cmd_generate(a: argparse.Namespace) -> int:
    from app.engine.sampling_params import SamplingParams
    from app.llm import LLM

    llm = LLM(config=engine_config_from_args(a))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                            seed=a.sampling_seed)
    if a.chat:
        out = llm.chat([{"role": "user", "content": a.prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate([a.prompt], params, use_tqdm=False)[0]
    print(out.text)
    llm.shutdown()
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    from models.resolve import export_model

    print(export_model(a.model, a.out_dir))
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    import gc

    # No collections while the imports and the load build the heap (each full one walks
    # all of it): `freeze_startup_heap` freezes that heap and turns collection back on.
    gc.disable()
    from app.server import run_server

    return run_server(engine_config_from_args(a), ServerSettings.from_kwargs(**vars(a)))


def cmd_plan(a: argparse.Namespace) -> int:
    """The memory plan and the roofline for a model, without serving it (no device needed)."""
    import json
    import logging

    from app.config import parse_bytes
    from app.engine.plan import format_plan, offline_plan
    from gpu.roofline import DevicePeaks

    if (a.peak_bandwidth_gbps is None) != (a.peak_tflops is None):
        raise SystemExit("give both --peak-bandwidth-gbps and --peak-tflops, or neither")
    peaks = None if a.peak_tflops is None else DevicePeaks(
        a.peak_bandwidth_gbps * 1e9, a.peak_tflops * 1e12, device="given", dtype="given",
        how="given on the command line")
    logging.getLogger("ridgeline.memory").setLevel(logging.WARNING)  # printed below instead
    report = offline_plan(engine_config_from_args(a),
                          parse_bytes(a.device_memory) if a.device_memory else None, peaks,
                          a.measure_peaks)
    print(json.dumps(report, indent=2) if a.json else format_plan(report))
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    if a.bench_cmd == "throughput":
        from app.bench.throughput import run

        return run(a, engine_config_from_args(a))
    if a.bench_cmd == "overhead":
        from app.bench.overhead import run as run_overhead

        return run_overhead(a)
    from app.bench.serve import run as run_serve

    return run_serve(a)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ridgeline", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s)
    add_settings(s, ServerSettings, title="server")
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("generate", help="complete one prompt and print it")
    add_engine_args(g)
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("plan", help="the memory plan and the roofline for a model, without "
                       "serving it: weights, KV bytes per token, pool, concurrency, and where "
                       "decode and prefill steps sit against the device's peaks")
    add_engine_args(p)
    p.add_argument("--device-memory", default=None,
                   help="plan for a GPU of this much memory (e.g. 80GiB) that this machine "
                   "need not have; the pool is then an upper bound")
    p.add_argument("--measure-peaks", action="store_true",
                   help="measure this machine's copy bandwidth and matmul throughput")
    p.add_argument("--peak-bandwidth-gbps", type=float, default=None,
                   help="the device's memory bandwidth in GB/s (e.g. from its data sheet)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's matmul TFLOP/s in the served dtype")
    p.add_argument("--json", action="store_true", help="print the report as JSON (as GET /plan)")
    p.set_defaults(func=cmd_plan)

    e = sub.add_parser("export-model", help="write the (default) model as an HF directory")
    e.add_argument("out_dir")
    e.add_argument("--model", default=None)
    e.set_defaults(func=cmd_export)

    r = sub.add_parser("replicas", help="N `ridgeline serve` replicas behind vllm-router")
    from app import replicas

    replicas.add_arguments(r)
    r.set_defaults(func=lambda a: replicas.run(a))

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    t = bsub.add_parser("throughput", help="offline throughput (optionally vs HF transformers)")
    add_engine_args(t)
    t.add_argument("--num-prompts", type=int, default=64)
    t.add_argument("--input-len", type=int, default=32)
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--compare", choices=["hf"], default=None)
    t.add_argument("--hf-batch-size", type=int, default=16)
    t.add_argument("--output-json", default="bench_results/throughput.json")
    t.set_defaults(func=cmd_bench)

    v = bsub.add_parser("serve", help="online latency/throughput against a running server "
                        "(any OpenAI-compatible one); vLLM's flag names")
    serve_args.add_arguments(v)
    v.set_defaults(func=cmd_bench)

    o = bsub.add_parser("overhead", help="server overhead: event-loop lag and per-token time "
                        "outside the model, with a tiny random model and many SSE streams")
    o.add_argument("--model", default=None, help="default: a tiny random Llama")
    o.add_argument("--num-streams", type=int, default=256)
    o.add_argument("--max-tokens", type=int, default=64)
    o.add_argument("--prompt-len", type=int, default=16)
    o.add_argument("--output-json", default="bench_results/overhead.json")
    o.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd != "bench" or args.bench_cmd != "serve":
        # The engine's commands log through structlog, which the light client install
        # (`bench serve` only) does not have.
        from app.logging_setup import configure_logging

        configure_logging()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
