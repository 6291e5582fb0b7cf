"""The HTTP gateway (`python -m gateway`): OpenAI and SGLang APIs over the tokenizer's gRPC API."""

from ringserve import grpc_env

grpc_env.apply()
