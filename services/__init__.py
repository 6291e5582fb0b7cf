"""ringserve's backend services: tokenizer, scheduler and detokenizer (`python -m services.<name>`)."""

from ringserve import grpc_env

grpc_env.apply()
