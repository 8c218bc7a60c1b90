"""The `lockstep` command: `lockstep serve [server args]`, `lockstep models`,
`lockstep bench NAME [args]`, `lockstep router [router args]`."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from lockstep.model_loader.packaged import DEFAULT_MODEL, PACKAGED_MODELS
from lockstep.server_args import ServerArgs
from lockstep.utils.flags import from_flags

DESCRIPTION = "lockstep: an SGLang-compatible LLM serving runtime (peer schedulers in lockstep)."
SERVE_DESCRIPTION = f"""\
Start the HTTP server: a chat page at /, SGLang's native API (/generate) and OpenAI's
(/v1/completions, /v1/chat/completions, /v1/models), plus /health, /metrics and the control
routes. With no flags it serves the packaged {DEFAULT_MODEL} on http://127.0.0.1:30000;
--model-path takes a GGUF file, an HF directory or a packaged model's short name
({", ".join(PACKAGED_MODELS)}: `lockstep models` lists them)."""
SERVE_EPILOG = """examples:
  lockstep serve
  lockstep serve --model-path gemma-3-270m
  lockstep serve --model-path ~/models/Qwen2.5-0.5B-Instruct --port 8000
  lockstep serve --tp-size 2 --max-total-tokens 65536 --api-key sk-local
  curl http://127.0.0.1:30000/generate -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 16}}'"""


def serve_parser(prog: str = "lockstep serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, usage="%(prog)s [OPTIONS]", description=SERVE_DESCRIPTION, epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    return parser


def run_serve(argv: Sequence[str], prog: str = "lockstep serve") -> None:
    parser = serve_parser(prog)
    args = from_flags(parser, ServerArgs, parser.parse_args(list(argv)))
    from lockstep.entrypoints.serve import launch_server

    launch_server(args)


def list_models() -> str:
    """`lockstep models`: the packaged models, whether each is installed, and how to install it."""
    rows = [("NAME", "KIND", "LICENCE", "INSTALLED"), *(
        (m.name + (" (default)" if m.name == DEFAULT_MODEL else ""), m.kind, m.licence,
         "yes" if m.installed() else f"no: {m.install_command}")
        for m in PACKAGED_MODELS.values())]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3] for r in rows]
    lines += ["", *(f"{m.name}: {m.about} (wheel {m.requirement})" for m in PACKAGED_MODELS.values()),
              "", "Serve one with `lockstep serve --model-path NAME`; any GGUF file or HF "
              "directory works as --model-path too."]
    return "\n".join(lines)


def _benchmarks() -> list[str]:
    import lockstep.bench as bench

    return sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_"))


def run_bench(name: str, argv: Sequence[str]) -> int:
    available = _benchmarks()
    if name not in available:
        print(f"lockstep bench: unknown benchmark {name!r} (available: {', '.join(available)})",
              file=sys.stderr)
        return 2
    module = importlib.import_module(f"lockstep.bench.{name}")
    if (main := getattr(module, "main", None)) is None:
        print(f"lockstep bench: lockstep.bench.{name} has no main()", file=sys.stderr)
        return 2
    sys.argv = [f"lockstep bench {name}", *argv]
    return main(list(argv)) or 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="lockstep", description=DESCRIPTION,
        epilog="Run 'lockstep COMMAND --help' for a command's options.")
    from lockstep import __version__

    parser.add_argument("--version", action="version", version=f"lockstep {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    benches = ", ".join(_benchmarks())
    for name, what in (("serve", "start the HTTP server (chat page, SGLang and OpenAI APIs)"),
                       ("models", f"list the packaged models ({', '.join(PACKAGED_MODELS)})"),
                       ("bench", f"run a benchmark: lockstep bench NAME [ARGS] ({benches})"),
                       ("router", "route requests across several servers (same HTTP API)")):
        sub.add_parser(name, help=what, add_help=False)
    if not argv or argv[0] not in sub.choices:
        parser.parse_args(argv)  # --help, --version, or an error naming the commands
        parser.print_help()
        return 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        run_serve(rest)
        return 0
    if command == "models":
        if rest and rest[0] not in ("-h", "--help"):
            print(f"lockstep models: takes no arguments (got {rest[0]!r})", file=sys.stderr)
            return 2
        print(list_models())
        return 0
    if command == "router":
        from lockstep.router.server import main as router_main

        return router_main(rest)
    if not rest or rest[0] in ("-h", "--help"):
        print("usage: lockstep bench NAME [ARGS]\n\nbenchmarks: " + benches)
        return 0 if rest else 2
    return run_bench(rest[0], rest[1:])


if __name__ == "__main__":
    sys.exit(main())
