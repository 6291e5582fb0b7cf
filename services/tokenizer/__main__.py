"""`python -m services.tokenizer`: the public InferenceService (what the container runs)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from ringserve.logs import setup_logging
from ringserve.model_source import exit_on_model_error, require_files, resolve_model, served_name

from .config import TokenizerConfig, load_config
from .server import TokenizerServer


async def run(cfg: TokenizerConfig) -> None:
    # Built inside the running loop: grpc.aio servers and channels bind to the loop that creates them.
    await TokenizerServer(cfg).serve()


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(argv)
    with exit_on_model_error():
        path = require_files(resolve_model(cfg.model, prepare=False), cfg.model, "tokenizer.json")
    # Unless a name was given, the served name follows what is served (config derived it from --model).
    named = cfg.served_model_name != Path(cfg.model.rstrip("/")).name
    cfg = replace(cfg, model=str(path),
                  served_model_name=cfg.served_model_name if named else served_name(cfg.model, path))
    setup_logging("tokenizer", cfg.log_level)
    asyncio.run(run(cfg))


if __name__ == "__main__":
    main()
