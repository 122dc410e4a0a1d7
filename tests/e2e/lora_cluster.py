"""The LoRA cluster run of test_lora_e2e.py, in a process of its own: the ingress mode (HAProxy, as
`tandem serve` picks where Ray finds its binary) is a setting Ray's processes read when they start.

Two CPU replicas of a tiny Llama serve four adapters: three from `lora_modules`, one loaded at run time
through `POST /v1/load_lora_adapter`. Rounds of greedy requests for each adapter (and the base model) go
over HTTP through HAProxy, whose route hook hands the body to the router, and a few through the handle;
each replica's stats say which adapters it holds and how many requests it served for each. Then the
replica holding the run-time adapter is killed; once Serve has replaced it, the same requests run again.
Writes what it saw as JSON to argv[1]; argv[2] is a scratch directory.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

APP = "lora-e2e"
ADAPTERS = ["alpha", "beta", "gamma", "delta"]  # delta is loaded at run time
ROUNDS = 4


def _post(base: str, path: str, body: dict[str, Any]) -> tuple[int, str]:
    request = urllib.request.Request(
        base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _complete(base: str, model: str, prompt: str) -> dict[str, Any]:
    status, text = _post(
        base, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    )
    return {"status": status, "text": json.loads(text)["choices"][0]["text"] if status == 200 else text}


def _replica_stats(handle: Any) -> dict[str, dict[str, Any]]:
    results = handle.broadcast("replica_stats").results(timeout_s=60)
    return {
        r["replica"]: {"held": r.get("lora_held", []), "requests": r.get("lora_requests", {})}
        for r in results
    }


def _phase(base: str, handle: Any, prompts: list[str]) -> dict[str, Any]:
    texts: dict[str, list[str]] = {}
    errors: list[str] = []
    for round_ in range(ROUNDS):
        for model in [*ADAPTERS, "tiny"]:
            out = _complete(base, model, prompts[round_])
            if out["status"] != 200:
                errors.append(f"{model}: {out['status']} {out['text'][:200]}")
            texts.setdefault(model, []).append(out["text"])
    # At once, before the replicas' reports can have reached it: the handle's router is not HAProxy's
    # route hook and shares none of its placements, yet sends each adapter to the same replica.
    for model in ADAPTERS:  # the handle API routes on its body too
        body = {"model": model, "prompt": prompts[0], "max_tokens": 8, "temperature": 0}
        answer = handle.completions.remote(body).result(timeout_s=120)
        texts.setdefault(f"handle:{model}", []).append(
            answer["choices"][0]["text"] if "choices" in answer else str(answer)
        )
    return {"texts": texts, "errors": errors}


def main() -> None:
    out, scratch = Path(sys.argv[1]), Path(sys.argv[2])
    from tandem.deploy.routing.ingress_mode import ray_environment

    # Short: Ray puts the node id under it, and HAProxy's socket paths stop at 97 characters.
    state = tempfile.mkdtemp(prefix="tandem-", dir="/tmp")
    os.environ.update(ray_environment("haproxy", state))
    import ray
    from ray import serve

    from tandem.deploy.app import build_app
    from tandem.engine.tiny import make_tiny_model
    from tandem.engine.tiny.adapters import write_random_adapter

    model_dir = make_tiny_model(scratch / "model", "llama", seed=3)
    paths = {
        n: write_random_adapter(scratch / n, model_dir, rank=4, seed=10 + i) for i, n in enumerate(ADAPTERS)
    }
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog, and then" for i in range(ROUNDS)]
    result: dict[str, Any] = {}
    ray.init(num_cpus=8, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app_args = {
            "model": str(model_dir),
            "served_model_name": "tiny",
            "device": "cpu",
            "num_replicas": 2,
            "lora_modules": {n: str(paths[n]) for n in ADAPTERS[:3]},
            "engine": {"max_loras": 2, "num_pages": 512, "page_size": 4},
        }
        serve.run(build_app(app_args), name=APP, route_prefix="/")
        handle = serve.get_app_handle(APP)
        result["load"] = _post(
            base, "/v1/load_lora_adapter", {"lora_name": "delta", "lora_path": str(paths["delta"])}
        )
        result["bad_load"] = _post(
            base, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(scratch / "no")}
        )
        result["before"] = _phase(base, handle, prompts)
        result["stats_before"] = _replica_stats(handle)
        holder = next(tag for tag, s in result["stats_before"].items() if "delta" in s["held"])
        actor = next(
            a
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].endswith(holder.split("#")[-1]) and "LLMServer" in a["name"]
        )
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            time.sleep(2)
            try:
                stats = _replica_stats(handle)
            except Exception:
                continue
            if len(stats) == 2 and holder not in stats:
                break
        result["replaced"] = holder not in _replica_stats(handle)
        models = [
            json.loads(urllib.request.urlopen(base + "/v1/models", timeout=30).read())["data"]
            for _ in range(6)
        ]
        result["models_after"] = [sorted(c["id"] for c in data) for data in models]
        result["after"] = _phase(base, handle, prompts)
        result["stats_after"] = _replica_stats(handle)
        result["killed"] = holder
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(state, ignore_errors=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
