"""python -m services.detokenizer --host 127.0.0.1 --port 50053 --metrics-port 9093 --model M"""

from __future__ import annotations

from dataclasses import replace

from ringserve import grpc_server
from ringserve.config import parse_config
from ringserve.logs import setup_logging
from ringserve.model_source import exit_on_model_error, require_files, resolve_model
from services.detokenizer.config import DetokenizerConfig
from services.detokenizer.server import serve


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(DetokenizerConfig, argv)
    with exit_on_model_error():
        path = require_files(resolve_model(cfg.model, prepare=False), cfg.model, "tokenizer.json")
    cfg = replace(cfg, model=str(path))
    setup_logging("detokenizer")
    grpc_server.run(serve(cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
