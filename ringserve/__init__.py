"""Shared code of the ringserve services: config, logging, gRPC bootstrap, tokenizer files.

`ringserve.v1` is generated from protos/ by `make proto` and is not kept in git.
"""

__version__ = "0.1.0"
