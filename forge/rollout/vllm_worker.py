"""The vLLM engine process behind `rollout.backend: vllm`: one `vllm.LLM` behind a small JSON-over-HTTP server.

Run by the vLLM virtual environment's python (`.venv-vllm/bin/python forge/rollout/vllm_worker.py ...`), never
by the main one: vLLM's pins conflict with Prefect's. So this file imports only vllm, torch, safetensors and the
standard library, nothing from forge.

Endpoints (127.0.0.1 by default; one request at a time, the engine is not thread-safe):
- `GET /health` -> {"ok": true, "policy_version": v, "model": dir}
- `POST /generate` {"prompt_token_ids": [[int]], "seeds": [int], "temperature", "top_p", "max_tokens",
  "stop_token_ids": [int], "policy_version": v} -> {"completions": [{"token_ids", "logprobs", "finish_reason"}],
  "policy_version": v}. One request per row (the caller expands the G samples of a prompt itself, each with its
  own seed; prefix caching shares the prompt's KV blocks). A `policy_version` other than the loaded one is
  refused with 409: a rollout can never silently sample from stale weights.
- `POST /load_weights` {"path": file} -> {"policy_version": v, "seconds": s}. The file is one written by
  `forge.weights.publish_weights`; tensors and the version come from the same open file, so they always match.
  The new tensors go through the model's own `load_weights` (vLLM's in-place `reload_weights`), then the prefix
  cache is reset: cached KV blocks were computed by the old weights.

Sampling log-probs: the engine runs with `logprobs_mode="processed_logprobs"`, so the log-prob returned for a
sampled token is under the distribution it was sampled from (after temperature and top-p), as the hf backend's.
The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): no grandchild processes to orphan.
When the parent process dies (even by SIGKILL) the worker notices within a second and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="forgeweave vLLM rollout worker")
    ap.add_argument("--model", required=True, help="HF model directory (weights + tokenizer)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 = any free port (written to --ready-file)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--policy-version", type=int, default=0, help="version of the weights in --model")
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="CPU KV cache (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="CUDA only")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=0, help="0 = the model's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (faster start, slower decode)")
    ap.add_argument("--ready-file", default="", help="written (JSON: port, pid) once the engine serves")
    ap.add_argument("--watch-parent", action="store_true", help="exit when the parent process dies")
    return ap.parse_args(argv)


def build_engine(args: argparse.Namespace):
    from vllm import LLM

    kwargs = {
        "model": args.model,
        "dtype": args.dtype,
        "seed": args.seed,
        "tensor_parallel_size": args.tensor_parallel_size,
        "logprobs_mode": "processed_logprobs",
        "generation_config": "vllm",  # sampling settings come from the request only, never the model's defaults
        "enable_prefix_caching": True,
        "enforce_eager": args.enforce_eager,
    }
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    if _has_cuda():
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    return LLM(**kwargs)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class Engine:
    """The LLM plus the policy version of the weights it holds."""

    def __init__(self, llm, model: str, version: int):
        self.llm = llm
        self.model = model
        self.policy_version = version

    def generate(self, req: dict) -> dict:
        from vllm import SamplingParams, TokensPrompt

        if int(req["policy_version"]) != self.policy_version:
            raise VersionMismatch(
                f"engine holds policy version {self.policy_version}, asked for {req['policy_version']}"
            )
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in req["prompt_token_ids"]]
        params = [
            SamplingParams(
                n=1,
                temperature=float(req["temperature"]),
                top_p=float(req["top_p"]) if float(req["temperature"]) > 0 else 1.0,
                top_k=0,
                max_tokens=int(req["max_tokens"]),
                stop_token_ids=list(req["stop_token_ids"]),
                logprobs=0,
                seed=int(seed),
                detokenize=False,
            )
            for seed in req["seeds"]
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return {"completions": [_completion(o.outputs[0]) for o in outputs], "policy_version": self.policy_version}

    def load_weights(self, path: str) -> dict:
        start = time.perf_counter()
        tensors, version = read_published(path)
        self.llm.collective_rpc(_reload_in_worker, kwargs={"tensors": tensors})
        self.llm.reset_prefix_cache()
        self.policy_version = version
        return {"policy_version": version, "seconds": time.perf_counter() - start}


class VersionMismatch(Exception):
    pass


def read_published(path: str) -> tuple[dict, int]:
    """(tensors, policy version) from one open of a file written by forge.weights.publish_weights."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        version = int((f.metadata() or {})["policy_version"])
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    return tensors, version


def _reload_in_worker(worker, tensors: dict) -> None:
    """Runs inside vLLM's worker: the model's own checkpoint-name loader (fuses q/k/v, gate/up; repacks for CPU).

    vLLM 0.32's in-place reload leaves a tied LM head on its old weights (it loads nothing for it and puts the
    old kernel tensors back), so with tied embeddings the head is re-pointed at the new embedding and re-processed.
    """
    worker.reload_weights(weights_iterator=iter(tensors.items()))
    model = worker.model_runner.get_model()
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is not None and embed is not None and getattr(model.config, "tie_word_embeddings", False):
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)


def _completion(out) -> dict:
    ids = list(out.token_ids)
    logprobs = [float(step[token].logprob) for token, step in zip(ids, out.logprobs, strict=True)]
    return {"token_ids": ids, "logprobs": logprobs, "finish_reason": out.finish_reason}


def make_handler(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path != "/health":
                return self._send(404, {"error": f"no route {self.path}"})
            self._send(200, {"ok": True, "policy_version": engine.policy_version, "model": engine.model})

        def do_POST(self):  # noqa: N802
            routes = {"/generate": engine.generate, "/load_weights": lambda r: engine.load_weights(r["path"])}
            if self.path not in routes:
                return self._send(404, {"error": f"no route {self.path}"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                self._send(200, routes[self.path](body))
            except VersionMismatch as e:
                self._send(409, {"error": str(e)})
            except Exception as e:  # the caller gets the error; the engine keeps serving
                self._send(500, {"error": f"{type(e).__name__}: {e}"})

        def _send(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):  # quiet: one line per request is noise in the run's engine log
            pass

    return Handler


def watch_parent(parent: int) -> None:
    """Exit at once when the process that started us is gone (reparented): never outlive the run."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def write_ready(path: str, port: int) -> None:
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
    os.replace(tmp, target)


def main(argv: list[str] | None = None) -> None:
    # run as a script, Python puts this file's folder first on sys.path, where forge/rollout/vllm.py would shadow
    # the vllm package: drop it before anything imports vllm
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    args = parse_args(argv)
    if args.watch_parent:
        threading.Thread(target=watch_parent, args=(os.getppid(),), daemon=True).start()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    engine = Engine(build_engine(args), args.model, args.policy_version)
    server = HTTPServer((args.host, args.port), make_handler(engine))
    port = server.server_address[1]
    if args.ready_file:
        write_ready(args.ready_file, port)
    print(f"forgeweave vLLM worker serving on http://{args.host}:{port}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
