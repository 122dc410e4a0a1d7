"""LoRA over the HTTP routes, on the real `AdapterRegistry` and the real adapter checks against a tiny
model, over the fake replica (no Ray, no ranks): /v1/models lists each adapter with its base as `parent`;
a request names one by `model` (plain or `<base>:<name>`) and runs with it; adapters under
`lora_dynamic_path` (a local folder, or a URI fetched through fsspec) load on first use; load and unload at
run time; and every bad input is a 4xx in OpenAI's shape that leaves the server serving."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import fsspec
import httpx
import pytest

from tandem.deploy.adapters.registry import AdapterRegistry
from tandem.deploy.serving.http import build_http_app
from tandem.deploy.serving.openai_service import OpenAIService
from tandem.engine.tiny.adapters import write_random_adapter
from tandem.replicas.lora_catalog import LoraCatalog
from tandem.scheduler.messages import LoRARequest

from ..fakes import MODEL, FakeReplica, InProcessBackend


class LoraReplica(FakeReplica):
    """The fake replica plus the LoRA side of `LLMReplica`, with the real `LoraCatalog` checks."""

    def __init__(self, catalog: LoraCatalog) -> None:
        super().__init__(max_model_len=256)
        self.catalog = catalog
        self.lora_enabled = catalog.enabled
        self.removed: list[str] = []

    async def check_lora(self, path: str) -> None:
        self.catalog.check(path)

    async def add_lora(self, name: str, path: str) -> LoRARequest:
        return self.catalog.add(name, path)[0]

    async def remove_lora(self, name: str) -> bool:
        self.removed.append(name)
        return self.catalog.remove(name) is not None

    def lora(self, name: str) -> LoRARequest | None:
        return self.catalog.get(name)

    def loras(self) -> list[LoRARequest]:
        return self.catalog.all()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tandem.engine.config import ModelConfig

    model_dir = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("http-lora")
    made = {
        name: write_random_adapter(root / "dyn" / name, model_dir, rank=4, seed=i)
        for i, name in enumerate(["sql", "chat", "dyn1", "remote"])
    }
    dora = write_random_adapter(root / "dora", model_dir, rank=4, use_dora=True)
    big = write_random_adapter(root / "big", model_dir, rank=32)
    return {"config": ModelConfig.from_dir(model_dir), "root": root, "dora": dora, "big": big, **made}


def make(
    adapters: dict[str, Any], tmp_path: Path, *, enabled: bool = True, dynamic: str | None = None
) -> Any:
    replica = LoraReplica(LoraCatalog(adapters["config"], 16, enabled))
    registry = AdapterRegistry(
        replica,
        MODEL,
        modules={"sql": str(adapters["sql"]), "chat": str(adapters["chat"])},
        dynamic_path=dynamic,
        cache_dir=tmp_path / "cache",
    )
    announced: list[tuple[str, tuple[Any, ...]]] = []

    async def announce(method: str, args: tuple[Any, ...]) -> None:
        announced.append((method, args))

    service = OpenAIService(InProcessBackend(replica), MODEL, adapters=registry, announce=announce)
    return build_http_app(service), replica, registry, announced


def call(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


def complete(app: Any, model: str) -> httpx.Response:
    return call(app, "POST", "/v1/completions", json={"model": model, "prompt": [5, 6, 7], "max_tokens": 2})


def test_models_list_adapters_and_requests_run_with_them(adapters: dict[str, Any], tmp_path: Path) -> None:
    app, replica, _, _ = make(adapters, tmp_path)
    cards = call(app, "GET", "/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [MODEL, "sql", "chat"]
    assert cards[0]["parent"] is None and all(c["parent"] == MODEL for c in cards[1:])
    assert cards[1]["root"] == str(adapters["sql"])
    for model, adapter in (("sql", "sql"), (f"{MODEL}:chat", "chat"), (MODEL, None)):
        response = complete(app, model)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        used = replica.loras[-1]
        assert (used.name if used is not None else None) == adapter
    assert replica.loras[0] == replica.catalog.get("sql")  # the id the ranks key the adapter by


def test_unknown_models_are_404s_in_openai_shape(adapters: dict[str, Any], tmp_path: Path) -> None:
    app, _, _, _ = make(adapters, tmp_path, dynamic=str(adapters["root"] / "dyn"))
    for model in ("nope", f"{MODEL}:nope", "other-base:sql"):
        response = complete(app, model)
        assert response.status_code == 404, (model, response.text)
        error = error_of(response)
        assert error["code"] == "model_not_found"
        # The 404 names what this server does serve: the base, each adapter, and the dynamic form.
        assert f"serves '{MODEL}', 'sql' and 'chat'" in error["message"], error["message"]
        assert f"'{MODEL}:<name>'" in error["message"]
    off, _, _, _ = make(adapters, tmp_path, enabled=False)
    assert complete(off, "sql").status_code == 404
    assert complete(off, MODEL).status_code == 200


def test_dynamic_adapters_load_on_first_use_from_a_folder_or_a_uri(
    adapters: dict[str, Any], tmp_path: Path
) -> None:
    # A URI fsspec reads: the files are fetched once into the local cache, and the ranks read the copy.
    remote = "memory://lora-store"
    fs = fsspec.filesystem("memory")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        fs.pipe(f"/lora-store/remote/{name}", (adapters["remote"] / name).read_bytes())
    for dynamic, name in ((str(adapters["root"] / "dyn"), "dyn1"), (remote, "remote")):
        app, replica, registry, _ = make(adapters, tmp_path, dynamic=dynamic)
        assert complete(app, name).status_code == 404  # the dynamic form is `<base>:<name>`
        response = complete(app, f"{MODEL}:{name}")
        assert response.status_code == 200, response.text
        assert replica.loras[-1] is not None and replica.loras[-1].name == name
        assert name in registry.known()
        assert complete(app, name).status_code == 200  # known by its name from now on
        assert name in [c["id"] for c in call(app, "GET", "/v1/models").json()["data"]]
    cached = list((tmp_path / "cache").iterdir())
    assert len(cached) == 1 and (cached[0] / "adapter_model.safetensors").is_file()


def test_load_and_unload_at_run_time(adapters: dict[str, Any], tmp_path: Path) -> None:
    app, replica, _, announced = make(adapters, tmp_path)
    body = {"lora_name": "dyn1", "lora_path": str(adapters["dyn1"])}
    response = call(app, "POST", "/v1/load_lora_adapter", json=body)
    assert response.status_code == 200 and "dyn1" in response.text
    assert announced == [("learn_lora_adapter", ("dyn1", str(adapters["dyn1"])))]
    assert replica.catalog.get("dyn1") is not None  # held by the replica that loaded it
    assert complete(app, "dyn1").status_code == 200
    again = call(app, "POST", "/v1/load_lora_adapter", json=body)
    assert again.status_code == 400 and "already been loaded" in error_of(again)["message"]
    gone = call(app, "POST", "/v1/unload_lora_adapter", json={"lora_name": "dyn1"})
    assert gone.status_code == 200 and replica.catalog.get("dyn1") is None
    assert announced[-1] == ("forget_lora_adapter", ("dyn1",))
    assert complete(app, "dyn1").status_code == 404
    missing = call(app, "POST", "/v1/unload_lora_adapter", json={"lora_name": "dyn1"})
    assert missing.status_code == 404 and error_of(missing)["param"] == "lora_name"


@pytest.mark.parametrize(
    "path_key,field",
    [("missing", "is not a directory"), ("dora", "use_dora"), ("big", "max_lora_rank=16")],
)
def test_a_bad_adapter_is_a_400_naming_it_and_the_server_stays_up(
    adapters: dict[str, Any], tmp_path: Path, path_key: str, field: str
) -> None:
    app, _, _, announced = make(adapters, tmp_path)
    path = str(adapters["root"] / "nowhere") if path_key == "missing" else str(adapters[path_key])
    response = call(app, "POST", "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert field in error["message"] and error["param"] == "lora_path"
    assert announced == []
    assert complete(app, "sql").status_code == 200
    bad_body = call(app, "POST", "/v1/load_lora_adapter", json={"lora_name": "x"})
    assert bad_body.status_code == 400 and error_of(bad_body)["param"] == "lora_path"
    named_base = call(app, "POST", "/v1/load_lora_adapter", json={"lora_name": MODEL, "lora_path": path})
    assert named_base.status_code == 400


def test_a_config_naming_a_bad_adapter_fails_on_its_first_request(
    adapters: dict[str, Any], tmp_path: Path
) -> None:
    """A `lora_modules` entry is checked when first used (the replica starts without reading it): a 400
    naming the problem, and the other adapters keep serving."""
    replica = LoraReplica(LoraCatalog(adapters["config"], 16, True))
    registry = AdapterRegistry(
        replica,
        MODEL,
        modules={"dora": str(adapters["dora"]), "sql": str(adapters["sql"])},
        cache_dir=tmp_path,
    )
    app = build_http_app(OpenAIService(InProcessBackend(replica), MODEL, adapters=registry))
    response = complete(app, "dora")
    assert response.status_code == 400 and "use_dora" in error_of(response)["message"]
    assert complete(app, "sql").status_code == 200
    assert json.loads(call(app, "GET", "/v1/models").text)["data"][1]["id"] == "dora"
