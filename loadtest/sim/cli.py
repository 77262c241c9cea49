"""`kvgate sim`: run one simulated vLLM replica on uvicorn (uvloop + httptools)."""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import socket
import sys

from loadtest.sim.app import SimApp, SimOptions
from loadtest.sim.costmodel import PRESETS, get_preset
from loadtest.sim.engine import Engine
from loadtest.sim.faults import Faults
from loadtest.sim.lora import parse_lora_modules
from loadtest.sim.spec import EngineConfig

__all__ = ["build_app", "main", "parser"]


def _port(text: str) -> int:
    """A TCP port (0: any free one); past 65535 the bind raised OverflowError, a traceback."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: a port from 0 to 65535")
    return port


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate sim", description="Run one simulated vLLM replica.")
    p.add_argument("--host", default="127.0.0.1", help="listen address (127.0.0.1)")
    p.add_argument("--port", type=_port, default=9001, help="listen port (9001)")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the names it is served under, as vLLM's flag: the first in answers and "
                        "metrics, each listed by /v1/models and accepted (default: --model, "
                        "then the cards' root)")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters, as vLLM's flag: /v1/load_lora_adapter and "
                        "/v1/unload_lora_adapter add and remove them at run time")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=[],
                   help="adapters served from the start (name=path, or vLLM's JSON form); "
                        "implies --enable-lora")
    p.add_argument("--max-loras", type=int, default=1,
                   help="adapters in one batch, as vLLM's flag (1; shown in the metrics only)")
    p.add_argument("--preset", default=PRESETS[0].name, choices=[x.name for x in PRESETS],
                   help=f"GPU and model profile: speeds, KV size ({PRESETS[0].name})")
    p.add_argument("--num-gpu-blocks", type=int, help="KV blocks (default: the preset's)")
    p.add_argument("--block-size", type=int, default=64,
                   help="tokens per KV block (vLLM 0.34's CacheConfig default: 64)")
    p.add_argument("--max-model-len", type=int,
                   help="longest context in tokens, as vLLM's flag (default: the preset's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens per engine step, as vLLM's flag (8192)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="requests running at once, as vLLM's flag (256)")
    p.add_argument("--no-enable-prefix-caching", action="store_true",
                   help="no prefix cache (every prompt computed whole)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="as vLLM's flag: fcfs, or priority (the request's `priority` field)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="simulated seconds per wall second (50 = 50x faster than real time)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault RNG")
    p.add_argument("--legacy-errors", action="store_true", help="flat error shape of vLLM<0.10.1")
    p.add_argument("--metrics-compat", choices=["current", "legacy"], default="current",
                   help="metric names of vLLM 0.34 (current) or of older releases (legacy)")
    p.add_argument("--api-key", action="append", default=[], help="repeatable; or VLLM_API_KEY")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="answers carry X-Request-Id, as vLLM's flag")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens in chat/completions answers")
    p.add_argument("--reasoning", action="store_true",
                   help="chat output starts with a thinking phase (delta.reasoning)")
    p.add_argument("--reasoning-parser", metavar="NAME",
                   help="as vLLM's flag: any name turns --reasoning on")
    p.add_argument("--sse-keep-alive-interval", type=float, default=0.0, metavar="S",
                   help="': keep-alive' comment lines every S wall seconds while a stream idles")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="N engines (each with --num-gpu-blocks) behind one frontend")
    p.add_argument("--disable-log-stats", action="store_true", help="no vllm:* metrics")
    p.add_argument("--enable-server-load-tracking", action="store_true",
                   help="GET /load counts in-flight requests (else it stays 0, as vLLM)")
    p.add_argument("--enable-store", action="store_true",
                   help="Responses API store (or VLLM_ENABLE_RESPONSES_API_STORE=1)")
    faults = p.add_argument_group("faults (also settable at runtime: POST /sim/faults)")
    faults.add_argument("--latency-ms", type=float, default=0.0,
                        help="wall-clock delay before a request enters the engine")
    faults.add_argument("--latency-jitter-ms", type=float, default=0.0,
                        help="plus up to this much, a fixed fraction per prompt")
    faults.add_argument("--error-rate", type=float, default=0.0,
                        help="probability that a generation request fails (0 to 1)")
    faults.add_argument("--error-status", type=int, choices=[500, 503], default=500,
                        help="the status of those failures (500)")
    faults.add_argument("--max-num-queued-reqs", type=int, default=0,
                        help="admission limit on waiting + running, as vLLM's flag (0: off)")
    faults.add_argument("--dead", action="store_true",
                        help="a dead engine: /health 503, requests 500, streams cut")
    faults.add_argument("--drop-connections", action="store_true",
                        help="connections closed without an answer")
    faults.add_argument("--engine-faulted", action="store_true",
                        help="vLLM's fault-tolerance pause: requests 503, /health 200")
    faults.add_argument("--health-latency-ms", type=float, default=0.0,
                        help="/health answers this much later")
    faults.add_argument("--hang-after-tokens", type=int, default=-1, metavar="K",
                        help="streams stop after K tokens and hang until the client leaves")
    faults.add_argument("--engine-hang", action="store_true",
                        help="the engine takes no step: no tokens, /health and /metrics 200")
    faults.add_argument("--slowdown", type=float, default=1.0, metavar="F",
                        help="every engine step F times as long as the preset's (a slower GPU)")
    p.add_argument("--log-level", default="warning",
                   help="debug, info, warning (default), error, critical")
    return p


def build_app(args: argparse.Namespace) -> SimApp:
    preset = get_preset(args.preset)
    if args.block_size < 1:  # before the division below (a ZeroDivisionError's traceback)
        raise ValueError("--block-size must be >= 1")
    # 0 given is refused by the engine, not taken for the preset's
    blocks = (args.num_gpu_blocks if args.num_gpu_blocks is not None
              else preset.num_gpu_blocks * 16 // args.block_size)
    if args.data_parallel_size < 1:
        raise ValueError("--data-parallel-size must be >= 1")
    if args.sse_keep_alive_interval < 0:
        raise ValueError("--sse-keep-alive-interval must be >= 0")
    if args.max_loras < 1:
        raise ValueError("--max-loras must be at least 1")
    if not (math.isfinite(args.slowdown) and args.slowdown > 0):
        raise ValueError("--slowdown must be a positive number")
    config = EngineConfig(
        cost=preset.cost.slower(args.slowdown), num_gpu_blocks=blocks, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len or preset.max_model_len,
        enable_prefix_caching=not args.no_enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
    )
    faults = Faults(latency_ms=args.latency_ms, latency_jitter_ms=args.latency_jitter_ms,
                    error_rate=args.error_rate,
                    error_status=args.error_status, max_num_queued_reqs=args.max_num_queued_reqs,
                    dead=args.dead, drop_connections=args.drop_connections,
                    engine_faulted=args.engine_faulted, health_latency_ms=args.health_latency_ms,
                    hang_after_tokens=args.hang_after_tokens, engine_hang=args.engine_hang,
                    seed=args.seed)
    keys = tuple(args.api_key) or tuple(k for k in [os.environ.get("VLLM_API_KEY", "")] if k)
    names = args.served_model_name or [args.model]
    options = SimOptions(
        model=names[0], aliases=tuple(names[1:]), root=args.model, time_scale=args.time_scale,
        legacy_errors=args.legacy_errors,
        legacy_metrics=args.metrics_compat == "legacy", api_keys=keys,
        request_id_headers=args.enable_request_id_headers,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        reasoning=args.reasoning or bool(args.reasoning_parser),
        keep_alive_s=args.sse_keep_alive_interval, log_stats=not args.disable_log_stats,
        server_load_tracking=args.enable_server_load_tracking,
        enable_lora=args.enable_lora or bool(args.lora_modules),
        max_loras=args.max_loras,
        dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE", "").lower() in ("1", "true"),
        lora_modules=tuple(parse_lora_modules(args.lora_modules).items()),
        enable_store=args.enable_store or os.environ.get(
            "VLLM_ENABLE_RESPONSES_API_STORE", "").lower() in ("1", "true"),
    )
    return SimApp([Engine(config) for _ in range(args.data_parallel_size)], options, faults)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        app = build_app(args)
    except ValueError as exc:
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 2
    try:  # before uvicorn: its bind error is a log line and exit status 3
        sock = listen(args.host, args.port)
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        where = f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"
        print(f"kvgate sim: cannot listen on {where}: {reason}{_listen_hint(exc)}",
              file=sys.stderr)
        return 1
    import uvicorn  # imported late: `--help` and config errors stay fast

    logging.basicConfig(level=args.log_level.upper())
    config = uvicorn.Config(app, loop="uvloop", http="httptools", lifespan="on",
                            log_level=args.log_level, access_log=False)
    with sock:
        uvicorn.Server(config).run(sockets=[sock])
    return 0


def _listen_hint(exc: OSError) -> str:
    """The flag to change: the port only when it is taken or privileged; the host when it is
    not this machine's (another port would fail alike)."""
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return " (choose another host with --host: an address of this machine)"
    if exc.errno in (errno.EADDRINUSE, errno.EACCES):
        return " (choose another port with --port)"
    return ""


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (OSError when it cannot be had: a port in use)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock
