"""Stream a generation from the tokenizer's public gRPC API with the generated stubs.

    python examples/python_client.py --target 127.0.0.1:50051 --prompt "Hello" --max-new-tokens 32

Run from the repository root after `make proto` (the stubs live in ringserve/v1, generated from protos/).
The default model produces meaningless text; that is expected.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ringserve.v1 import api_pb2, api_pb2_grpc, common_pb2  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)

    sampling = common_pb2.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    if args.chat:
        chat = api_pb2.ChatInput(messages=[api_pb2.ChatMessage(role="user", content=args.prompt)])
        request = api_pb2.GenerateRequest(chat=chat, sampling_params=sampling, stream=True)
    else:
        request = api_pb2.GenerateRequest(text=args.prompt, sampling_params=sampling, stream=True)

    with grpc.insecure_channel(args.target) as channel:
        stub = api_pb2_grpc.InferenceServiceStub(channel)
        try:
            # wait_for_ready: wait for the server to come up instead of failing at once.
            for msg in stub.Generate(request, timeout=args.timeout, wait_for_ready=True):
                print(msg.text, end="", flush=True)
                if msg.finished:
                    meta = msg.meta_info
                    print(f"\n[rid={msg.rid} finish={meta.finish_reason.type} prompt_tokens={meta.prompt_tokens} "
                          f"completion_tokens={meta.completion_tokens} e2e={meta.e2e_latency:.3f}s]")
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
