"""`python -m services.tokenizer`: the public InferenceService (what the container runs)."""

from __future__ import annotations

from ringserve import grpc_server
from ringserve.logs import setup_logging
from ringserve.model_source import exit_on_model_error, require_files, resolve_model

from .config import TokenizerConfig, load_config
from .server import TokenizerServer


async def run(cfg: TokenizerConfig) -> None:
    # Built inside the running loop: grpc.aio servers and channels bind to the loop that creates them.
    await TokenizerServer(cfg).serve()


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(argv)
    with exit_on_model_error():  # a model that cannot be served: one line, before anything starts
        require_files(resolve_model(cfg.model, prepare=False), cfg.model, "tokenizer.json")
    setup_logging("tokenizer", cfg.log_level)
    grpc_server.run(run(cfg))


if __name__ == "__main__":
    main()
