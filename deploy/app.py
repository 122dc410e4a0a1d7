"""`build_app(args)`: the Serve application of a serve config (`import_path: tandem.deploy.app:build_app`).

One deployment, `LLMServer`, which is also the FastAPI ingress: one replica per TP group, each in a
placement group of `tp_size` rank bundles with the replica actor's own CPU merged into bundle 0
(STRICT_PACK by default). It carries the user's `num_replicas` / `autoscaling_config`.

A request thus crosses one Serve hop (proxy -> replica), not two: each hop costs milliseconds of time to
first token. The user's `max_ongoing_requests` and `max_queued_requests` are applied inside the replica
(`Admission`), and Serve is told to admit that much plus some slack, so overload becomes an OpenAI-shaped
503 from the app, never the proxy's plain-text one, and /health and /v1/models still get in under load.
"""

from __future__ import annotations

from typing import Any, cast

from ray.serve import Application
from ray.serve.deployment import Deployment

from tandem.deploy.config.args import TINY_MODEL_NAME, AppArgs
from tandem.deploy.config.capacity import replica_capacity
from tandem.deploy.guards.auth import resolve_api_keys
from tandem.deploy.protocol.templates import load_chat_template
from tandem.deploy.routing.prefix_routing import (
    autoscaling_config,
    prefix_routing_enabled,
    request_router_config,
    with_route_ingress,
)
from tandem.deploy.serving.server import QUEUED_PER_RUNNING, LLMServer

REPLICA_CPUS = 1.0  # the LLMServer actor itself: HTTP, tokenizing, detokenizing, the request streams
ADMISSION_SLACK = 64  # room for requests being turned away, /health and /v1/models under full load
DRAIN_TIMEOUT_S = 30.0
# Serve replaces a replica after 3 failed health checks in a row. A dead rank fails every request on its
# replica at once, so the replica is useless until replaced: check every 2 s (one heartbeat RPC per rank,
# negligible) so the gang restart starts ~6 s after a rank dies instead of Serve's default ~30 s.
HEALTH_CHECK_PERIOD_S = 2.0
# Serve runs a replica's user code on an event loop in a thread of its own by default, so every request
# and every streamed chunk crosses threads. The LLMServer blocks its loop only briefly (tokenizing; the
# model runs in the rank actors), so it runs on the replica's main loop, saving a thread hop per request
# and per chunk. The ranks inherit the variable and ignore it.
REPLICA_ENV_VARS = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    app_args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    device = resolve_device(app_args)
    app = (
        cast(Deployment, LLMServer)
        .options(**llm_server_options(app_args, device))
        .bind(
            app_args.model,
            app_args.resolved_served_model_name(),
            model_root=app_args.model or TINY_MODEL_NAME,
            tp_size=app_args.tp_size,
            device=device,
            engine=app_args.engine_kwargs(),
            placement_strategy=app_args.placement_strategy,
            cpus_per_rank=app_args.cpus_per_rank,
            max_running=app_args.max_ongoing_requests,
            max_queued=app_args.max_queued_requests,
            drain_timeout_s=DRAIN_TIMEOUT_S,
            # Resolved here, where the app is built: TANDEM_API_KEY and the template file are read on the
            # machine that deploys, not on every replica's node.
            api_keys=resolve_api_keys(app_args.api_keys()),
            max_request_body_bytes=app_args.max_request_body_bytes,
            max_choices_per_request=app_args.max_choices_per_request,
            prompt_chars_per_token=app_args.prompt_chars_per_token,
            chat_template=load_chat_template(app_args.chat_template),
            stuck_rank_timeout_s=app_args.stuck_rank_timeout_s,
            lora_modules=app_args.lora_modules,
            lora_dynamic_path=app_args.lora_dynamic_path,
            reasoning_parser=app_args.reasoning_parser,
            tool_call_parser=app_args.tool_call_parser,
            enable_auto_tool_choice=app_args.enable_auto_tool_choice,
            allowed_origins=app_args.allowed_origins,
        )
    )
    return with_route_ingress(app, app_args)


def resolve_device(args: AppArgs) -> str:
    """'cpu' or 'cuda'. The placement bundles need to know now whether ranks take a GPU.

    'auto' is CPU for the demo model; otherwise CUDA when the Ray cluster (or, without one, this
    machine) has a GPU. A cluster whose GPU nodes autoscale from zero shows none yet: set `device: cuda`.
    """
    if args.device != "auto":
        return args.device
    if args.model is None:
        return "cpu"
    import ray

    if ray.is_initialized():
        gpus = ray.cluster_resources().get("GPU", 0)  # type: ignore[no-untyped-call,unused-ignore]
        return "cuda" if gpus > 0 else "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def placement_bundles(args: AppArgs, device: str) -> list[dict[str, float]]:
    bundles = [args.rank_bundle(use_gpu=device == "cuda") for _ in range(args.tp_size)]
    bundles[0]["CPU"] = bundles[0].get("CPU", 0.0) + REPLICA_CPUS
    return bundles


def llm_server_options(args: AppArgs, device: str) -> dict[str, Any]:
    options: dict[str, Any] = {
        "max_ongoing_requests": serve_max_ongoing_requests(args, device),
        # Never queue at the proxy: a request past the replica's own queue gets the app's shaped 503.
        "max_queued_requests": -1,
        "ray_actor_options": {"num_cpus": REPLICA_CPUS, "runtime_env": {"env_vars": REPLICA_ENV_VARS}},
        "placement_group_bundles": placement_bundles(args, device),
        "placement_group_strategy": args.placement_strategy,
        # Loading weights (and capturing graphs) takes a while; let drain finish before Serve kills it.
        "graceful_shutdown_timeout_s": DRAIN_TIMEOUT_S + 10.0,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": 30.0,
    }
    scaling = autoscaling_config(args, device)
    if scaling is not None:
        options["autoscaling_config"] = scaling
    else:
        options["num_replicas"] = args.num_replicas or 1
    if prefix_routing_enabled(args):
        options["request_router_config"] = request_router_config(args, device)
    return options


def serve_max_ongoing_requests(args: AppArgs, device: str) -> int:
    """What Serve lets into one replica: everything `Admission` may run or queue there, plus slack for
    the requests it turns away and for /health and /v1/models. With an unbounded queue
    (`max_queued_requests: -1`), the queue term is the running bound again."""
    running = replica_capacity(args, device)
    queued = args.max_queued_requests
    if queued is None:
        queued = QUEUED_PER_RUNNING * running
    elif queued < 0:
        queued = running
    return running + queued + ADMISSION_SLACK
