"""`PrefixAffinityRouter`: a Serve request router that sends prompts sharing a prefix to one replica.

Each replica's radix cache keeps the KV of the prompts it served, so a request whose prompt starts like
an earlier one is cheapest on the replica that served that one. The router keeps Ray Serve LLM's
approximate, character-level prefix tree (`PrefixTree`, the tree behind `PrefixCacheAffinityRouter`)
of what it sent where, and picks:

1. for a prompt matching at least `match_rate_threshold` of its text, the least loaded of the replicas
   holding the longest match;
2. for a new prefix, the replica given the fewest new prefixes so far, then the least loaded (so a
   burst of new prefixes spreads evenly whatever the lagging load reports say);
3. but the least loaded replica if the pick runs `imbalanced_threshold` requests more than it.

Unlike `PrefixCacheAffinityRouter`, the tree lives in the router's own process, not in a detached actor
behind three blocking `ray.get` calls per request: routing adds no RPC. Each process that routes (the
ingress router replica under HAProxy, a Python caller holding a handle) keeps its own tree; HTTP traffic
all goes through the ingress router, so one tree sees it.

The router also records its pick itself rather than only in `on_request_routed`: Serve's pick-only path
(`choose_replica(..., _reserve=False)`, which HAProxy's ingress router uses) never calls that hook.

Load is the replica's ongoing requests: Serve's probed queue length when fresh (handle calls), else the
`ongoing` count that `LLMServer.record_routing_stats` reports each `request_routing_stats_period_s`.
Requests without a prompt (the proxy's unparsed HTTP body, `stats` calls) get power-of-two choices.

A request for a LoRA adapter (its body's `model`, or Serve's `multiplexed_model_id`: the handle option, or
the `serve_multiplexed_model_id` header, the only thing of an HTTP request Serve's Python proxy lets the
router see) goes to the replicas that hold the adapter first (adapter_affinity.py), and among them by
prefix as above; its prefixes are the adapter's own (KV computed under an adapter is that adapter's).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence
from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from tandem.deploy.protocol.model_names import body_adapter
from tandem.deploy.routing.adapter_affinity import AdapterPlacements
from tandem.deploy.routing.prefix_routing import ONGOING_STAT

# The head of a prompt is what decides where its prefix is cached; past this, the tree only grows.
ROUTING_TEXT_CHARS = 32_768
_EVICTION_CHECK_EVERY = 64  # inserts between checks of the tree's size


def routing_text(args: Sequence[Any]) -> str | None:
    """The text a request is routed on: its prompt, or its chat messages' contents in order.

    The first argument is the request body: a dict (the handle API), or an object with `prompt` /
    `messages` attributes (Ray Serve LLM's parsed requests). Token-id prompts become their ids as text,
    so equal id prefixes are equal text prefixes. None when there is no prompt to route on.
    """
    if not args:
        return None
    body = args[0]
    if isinstance(body, dict):
        prompt, messages = body.get("prompt"), body.get("messages")
    else:
        prompt, messages = getattr(body, "prompt", None), getattr(body, "messages", None)
    text = _messages_text(messages) if messages is not None else _prompt_text(prompt)
    return text[:ROUTING_TEXT_CHARS] if text else None


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]  # a batch routes on its first prompt
        if isinstance(first, int):
            return ",".join(str(t) for t in prompt) + ","
        return _prompt_text(first)
    return ""


def _messages_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
        parts.append(_content_text(content))
    return "".join(parts)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        texts = (p.get("text") for p in content if isinstance(p, dict))
        return "".join(t for t in texts if isinstance(t, str))
    return ""


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(
        self,
        imbalanced_threshold: float = 32.0,
        match_rate_threshold: float = 0.1,
        eviction_threshold_chars: int = 400_000,
        eviction_target_chars: int = 360_000,
        served_model_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        """Options arrive as `request_router_config.request_router_kwargs`.

        - `imbalanced_threshold`: ongoing requests by which the affine replica may exceed the least
          loaded one before the least loaded one is taken instead.
        - `match_rate_threshold`: fraction of the prompt's text that must match to follow the match.
        - `eviction_*_chars`: a replica's share of the tree is cut back to the target, oldest first,
          once it passes the threshold (the replica's own cache evicts too, so old entries mislead).
        - `served_model_name`: the base model's name, to tell a body's adapter `model` from the base's.
        """
        self._served = served_model_name
        self._adapters = AdapterPlacements()
        self._imbalanced_threshold = imbalanced_threshold
        self._match_rate_threshold = match_rate_threshold
        self._eviction_threshold = eviction_threshold_chars
        self._eviction_target = eviction_target_chars
        self._tree = PrefixTree()
        self._inserts = itertools.count(1)
        self._placed: dict[str, int] = {}  # new prefixes given to each replica

    # ---- replica set -------------------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        old = set(self._replica_id_set)
        super().update_replicas(replicas)
        new = set(self._replica_id_set)
        if new - old:
            self._tree.add_tenants([r.to_full_id_str() for r in new - old], time.time())
            # A replica added later starts level with the fewest placed, not at zero: it takes its
            # share of new prefixes from now on rather than every one until it has caught up.
            floor = min(self._placed.values(), default=0)
            for replica in new - old:
                self._placed.setdefault(replica.to_full_id_str(), floor)
        if old - new:
            gone = [r.to_full_id_str() for r in old - new]
            self._tree.remove_tenants(gone)
            for tenant in gone:
                self._placed.pop(tenant, None)
                self._adapters.forget_replica(tenant)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._tree.remove_tenants([replica_id.to_full_id_str()])
        self._placed.pop(replica_id.to_full_id_str(), None)
        self._adapters.forget_replica(replica_id.to_full_id_str())

    # ---- routing -----------------------------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        text = self.routing_text(pending_request)
        adapter = self.adapter_of(pending_request)
        if adapter is not None:
            chosen = self._adapters.pick(
                adapter,
                candidate_replicas,
                self.load,
                self._imbalanced_threshold,
                lambda pool: self.pick(text, list(pool)) if text is not None else min(pool, key=self.load),
            )
            if text is not None:
                self._record(text, chosen.replica_id)
        elif text is None:
            pair = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
            return [sorted(pair, key=self.load)]
        else:
            chosen = self.pick(text, candidate_replicas)
            self._record(text, chosen.replica_id)
        if adapter is not None:
            # One rank only: a probe of the pick that misses its deadline (a busy host) would otherwise
            # send the request down the next rank, to a replica that then loads the adapter too. Serve
            # backs off and asks again, and `pick` moves the adapter on once its holders are full.
            return [[chosen]]
        # Serve tries the first rank, then the next if the pick has no room.
        rest = sorted((r for r in candidate_replicas if r is not chosen), key=self.load)
        return [[chosen], rest] if rest else [[chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        # Where the request really went (the pick may have been full): record that replica too.
        text = self.routing_text(pending_request)
        if text is not None:
            self._record(text, replica_id)
        adapter = self.adapter_of(pending_request)
        replica = self._replicas.get(replica_id)
        if adapter is not None and replica is not None:
            self._adapters.record(adapter, replica)

    def adapter_of(self, pending_request: PendingRequest | None) -> str | None:
        """The LoRA adapter a request is for: Serve's multiplexed model id, else its body's `model`."""
        if pending_request is None:
            return None
        model_id = getattr(pending_request.metadata, "multiplexed_model_id", "")
        if model_id:
            return str(model_id)
        args = pending_request.args
        return body_adapter(args[0], self._served) if args and self._served is not None else None

    def routing_text(self, pending_request: PendingRequest | None) -> str | None:
        """The prompt text a request is routed on, behind its adapter's name: each adapter caches its
        own KV, so its prefixes are its own."""
        text = routing_text(pending_request.args) if pending_request is not None else None
        adapter = self.adapter_of(pending_request)
        return text if text is None or adapter is None else f"{adapter}\x00{text}"

    def pick(self, text: str, candidates: list[RunningReplica]) -> RunningReplica:
        by_id = {r.replica_id.to_full_id_str(): r for r in candidates}
        loads = {t: self.load(r) for t, r in by_id.items()}
        sizes = self._tree.tenant_to_char_count
        matched, tenants = self._tree.prefix_match(text, list(by_id))
        new_prefix = not (tenants and matched and len(matched) >= self._match_rate_threshold * len(text))
        if not new_prefix:
            pool = [t for t in tenants or () if t in by_id] or list(by_id)
            chosen = min(pool, key=lambda t: (loads[t], sizes.get(t, 0)))
        else:
            # A new prefix: the replica given the fewest new prefixes, then the least loaded. Not load
            # first: reports lag a second behind, so one stale report of a single request would send a
            # whole burst of new prefixes to the other replica, whose cache then thrashes while the
            # first one's stays empty. Not cached size first (Ray's rule): a replica that had served
            # much unrelated traffic would leave every new prefix to the other.
            chosen = min(by_id, key=lambda t: (self._placed.get(t, 0), loads[t], sizes.get(t, 0)))
        least = min(by_id, key=lambda t: (loads[t], sizes.get(t, 0)))
        if loads[chosen] - loads[least] > self._imbalanced_threshold:
            chosen = least  # balance first: the cache only decides among replicas loaded alike
        if new_prefix:
            self._placed[chosen] = self._placed.get(chosen, 0) + 1
        return by_id[chosen]

    def load(self, replica: RunningReplica) -> float:
        """Ongoing requests: a fresh probe if Serve has one, else the replica's last report."""
        probed = self._replica_queue_len_cache.get(replica.replica_id)
        if probed is not None:
            return float(probed)
        reported = replica.routing_stats.get(ONGOING_STAT)
        return float(reported) if isinstance(reported, (int, float)) else 0.0

    def _record(self, text: str, replica_id: ReplicaID) -> None:
        tenant = replica_id.to_full_id_str()
        if tenant not in self._tree.tenant_to_char_count:
            return  # a replica being removed
        self._tree.insert(text, tenant, time.time())
        if next(self._inserts) % _EVICTION_CHECK_EVERY == 0:
            for name, chars in list(self._tree.tenant_to_char_count.items()):
                if chars > self._eviction_threshold:
                    self._tree.evict_tenant_by_lru(name, chars - self._eviction_target)
