"""The road both runtimes run: layouts, the one non-finite rule, the wire plan, telemetry."""

from __future__ import annotations

import pytest
import torch

from gradsift import make_compressor
from gradsift.compressors.base import NonFiniteGradient
from gradsift.route.netmodel import NetworkModel
from gradsift.route.plan import WirePlan
from gradsift.runtime.road import Group, Layout, Road
from gradsift.route.routing import Routing
from gradsift.transport.local import LocalGroup
from helpers import run_round


def roads(spec, n, ratio=0.1, **kw):
    plan = kw.pop("plan", None)
    routing = Routing(plan, []) if plan is not None else None
    return [Road(make_compressor(spec, ratio, rank=r, world_size=n, seed=3), routing, **kw) for r in range(n)]


def group_of(keys, xs):
    return Group(list(keys), [x.shape for x in xs], xs[0].dtype, lambda: list(xs))


def one_step(rs, group, keys, inputs):
    trips = [r.start(group_of(keys, x), group.endpoint(w)) for w, (r, x) in enumerate(zip(rs, inputs))]
    outs = [r.finish(t, t.pending.wait()) for r, t in zip(rs, trips)]
    return trips, outs


def test_layout_model_granularity_follows_parameter_order_whatever_the_bucket_order():
    grads_in_bucket_order = [torch.full((2,), 2.0), torch.full((3,), 1.0), torch.full((1,), 3.0)]
    lay = Layout(["a", "b", "c"], "model", order=[1, 0, 2])  # a is second in the bucket, b first
    (flat,) = lay.inputs(grads_in_bucket_order)
    assert flat.tolist() == [1.0, 1.0, 1.0, 2.0, 2.0, 3.0] and lay.keys == ["model"]
    out = [torch.zeros(2), torch.zeros(3), torch.zeros(1)]
    lay.write([flat * 10], out)
    assert [t.tolist() for t in out] == [[20.0, 20.0], [10.0, 10.0, 10.0], [30.0]]
    layer = Layout(["a", "b"], "layer")
    assert layer.keys == ["a", "b"] and [v.shape for v in layer.views([torch.ones(6), torch.ones(2)],
                                                                       [torch.Size([2, 3]), torch.Size([2])])] == [
        torch.Size([2, 3]), torch.Size([2])]


def test_road_without_plan_equals_compressors_and_transport_by_hand():
    keys, shapes = ["w", "b"], [(20, 10), (10,)]
    g = torch.Generator().manual_seed(0)
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    rs = roads("topk", 3)
    group = LocalGroup(3)
    for k, i in ((0, 0), (1, 1)):
        _, outs = one_step(rs, group, [keys[i]], [[grads[w][i]] for w in range(3)])
        by_hand = [make_compressor("topk", 0.1, rank=r, world_size=3, seed=3) for r in range(3)]
        _, means = run_round(by_hand, [keys[i]], [[grads[w][i]] for w in range(3)])
        assert torch.equal(outs[0][0], means[0])


@pytest.mark.parametrize("mode,spec", [("error", "topk"), ("skip", "topk"), ("skip", "topk:value_dtype=int2")])
def test_one_nonfinite_rule(mode, spec):
    """(2-bit values put their rounding back into the residual after the selection: a skip undoes that too.)"""
    n = 3
    rs = roads(spec, n, on_nonfinite=mode)
    group = LocalGroup(n)
    g = torch.Generator().manual_seed(1)
    x = lambda: torch.randn(40, generator=g)  # noqa: E731
    one_step(rs, group, ["w"], [[x()] for _ in range(n)])
    for r in rs:
        r.close_step()
    before = [r.compressor.state_dict() for r in rs]
    bad = [[x()], [x()], [x()]]
    bad[1][0][5] = float("inf")
    trips = [r.start(group_of(["w"], inp), group.endpoint(w)) for w, (r, inp) in enumerate(zip(rs, bad))]
    assert [t.flag for t in trips] == [0, 1, 0]
    assert all(torch.isfinite(p.values).all() for t in trips for p in t.payloads)  # worker 1 compressed zeros
    assert all(torch.isfinite(r.compressor.residual["w"]).all() for r in rs)
    if mode == "error":
        for w, (r, t) in enumerate(zip(rs, trips)):
            with pytest.raises(NonFiniteGradient, match="non-finite gradient on worker 1 at step 2"):
                r.finish(t, t.pending.wait())
        return
    assert all(r.finish(t, t.pending.wait()) is None for r, t in zip(rs, trips))
    for r, sd in zip(rs, before):
        skipped, _ = r.close_step()
        assert skipped and r.step == 1
        after = r.compressor.state_dict()
        assert torch.equal(after["residual"]["w"], sd["residual"]["w"])
        assert after["compressor"]["tensors"]["w"]["step"] == sd["compressor"]["tensors"]["w"]["step"]


def test_wire_plan_routes():
    net = NetworkModel(bandwidth_gbps=1.0, latency_us=50.0)  # one latency carries 6250 bytes: 1562 fp32 values
    plan = Routing(WirePlan(net, world_size=8), [])
    topk = make_compressor("topk", 0.01)
    assert plan.planned(topk, "bias", (1000,)).route == "whole"
    assert plan.planned(topk, "w", (100_000,)).route == "gather"
    dense_ratio = make_compressor("topk", 0.5)  # 8 workers' all-gathers of half the tensor outweigh an all-reduce
    d = Routing(WirePlan(net, world_size=8, sparse_collective="gather"), []).planned(dense_ratio, "w", (100_000,))
    assert d.route == "densify" and "slower" in d.reason
    assert plan.planned(dense_ratio, "w", (100_000,)).route == "densify"  # the plan never scatters unasked
    asked = Routing(WirePlan(net, world_size=8, sparse_collective="scatter"), [])
    assert asked.planned(dense_ratio, "w", (100_000,)).route == "scatter"  # (coded, bf16: its owners' sums cost less)
    dgc = make_compressor("dgc", 0.01)
    assert plan.planned(dgc, "bias", (100_000,)).route == "whole"  # DGC's own rule, plan or not
    off = Routing(WirePlan(net, world_size=8, enabled=False), [])
    assert off.planned(topk, "bias", (1000,)).route == "gather" and off.planned(dgc, "bias", (10,)).route == "whole"
    latest = plan.decisions()  # per key, the latest decision
    assert latest["w"].route == "densify" and latest["w"].by_plan
    assert latest["bias"].route == "whole" and not latest["bias"].by_plan  # DGC's own rule came last: the method's


def test_planned_routes_keep_the_means_and_count_the_bytes():
    n = 8
    g = torch.Generator().manual_seed(2)
    inputs = [[torch.randn(100_000, generator=g)] for _ in range(n)]
    net = NetworkModel(1.0, 50.0)
    res = {}
    for enabled in (False, True):
        rs = roads("topk", n, ratio=0.5, plan=WirePlan(net, n, enabled=enabled, sparse_collective="gather"), net=net)
        trips, outs = one_step(rs, LocalGroup(n), ["w"], inputs)
        _, tally = rs[0].close_step()
        res[enabled] = (outs[0][0], trips[0].routes, tally.fields())
    torch.testing.assert_close(res[True][0], res[False][0], rtol=1e-5, atol=1e-6)
    assert res[False][1] == ["gather"] and res[True][1] == ["densify"]
    gathered, densified = res[False][2], res[True][2]
    # the same payload: 50,000 bf16 values and a 100,000-bit bitmap of their indices
    assert densified["bytes_per_worker"] == gathered["bytes_per_worker"] == 50_000 * 2 + 100_000 // 8
    assert densified["wire_bytes_per_worker"] < gathered["wire_bytes_per_worker"]
    assert densified["est_comm_s"] < gathered["est_comm_s"]
    assert gathered["density"] == pytest.approx(0.5) and gathered["k_ratio"] == pytest.approx(1.0)


def test_a_selection_that_costs_more_than_the_bytes_it_saves_is_skipped():
    """On a fast link a slow selector does not pay; on a slow link it does (the model is fixed: every rank agrees)."""
    gsb, topk = make_compressor("gsb", 0.01), make_compressor("topk", 0.01)
    fast = Routing(WirePlan(NetworkModel(bandwidth_gbps=1.0, latency_us=50.0), world_size=2), [])
    slow = Routing(WirePlan(NetworkModel(bandwidth_gbps=0.1, latency_us=50.0), world_size=2), [])
    d = fast.planned(gsb, "head.weight", (12000, 200))
    assert d.route == "whole" and "selection" in d.reason
    assert slow.planned(gsb, "head.weight", (12000, 200)).route == "gather"
    assert fast.planned(topk, "head.weight", (12000, 200)).route == "gather"


class _Recording:
    """A transport endpoint that records where a group's means were offered to go (``sum_into``)."""

    def __init__(self, inner):
        self.inner, self.into = inner, []

    def start(self, *args, **kwargs):
        pending, outer = self.inner.start(*args, **kwargs), self

        class Pending:
            def __getattr__(self, name):
                return getattr(pending, name)

            def sum_into(self, buffer, starts):
                outer.into.append((buffer, starts))
        return Pending()


@pytest.mark.parametrize("granularity", ["layer", "model"])
def test_a_bucket_by_layer_has_its_means_summed_where_its_gradients_are(granularity):
    buffer = torch.randn(30)
    grads = [buffer[:10].view(2, 5), buffer[10:]]  # DDP's bucket: its gradients are views of one flat buffer
    lay = Layout(["a", "b"], granularity, [1, 0])  # parameter "a" sits second in the bucket
    link = _Recording(LocalGroup(1).endpoint(0))
    road = Road(make_compressor("topk", 0.2, rank=0, world_size=1, seed=3))
    road.start(lay.group(grads, buffer), link)
    if granularity == "layer":
        assert len(link.into) == 1 and link.into[0][0] is buffer and link.into[0][1] == [10, 0]
    else:  # the one "model" input is the gradients concatenated in parameter order, not the bucket
        assert link.into == []


@pytest.mark.parametrize("spec", ["gsb", "dense:value_dtype=bf16"])
@pytest.mark.parametrize("weights", [None, [1.0, 2.0, 3.0]])
def test_a_bucket_sent_whole_in_a_narrower_dtype_is_cast_once_with_the_whole_routes_arithmetic(spec, weights):
    """Every tensor of a bucket whole in the method's narrower wire dtype, no memory to keep the rounding: the
    bucket is cast once, summed in that copy and divided back into it -- the same means, bit for bit, as the whole
    route tensor by tensor (the bucket handed over without its buffer), and the same bytes counted."""
    n, sizes = 3, [7, 64 * 33, 1, 300]
    torch.manual_seed(5)
    grads = [[torch.randn(s) * (10.0 ** (i % 3)) for i, s in enumerate(sizes)] for _ in range(n)]
    grads[1][2][0] = 7e4  # beyond fp16's range: saturates as the whole route's cast does
    keys = [f"t{i}" for i in range(len(sizes))]

    def run(in_buffer):
        group = LocalGroup(n, weights)
        rs = roads(spec, n, 0.01)
        for r in rs:
            r.routing.mode = "whole"  # (what the plan chooses where whole steps are faster)
        trips, buffers = [], []
        for w, r in enumerate(rs):
            buffer = torch.cat(grads[w])
            views = list(buffer.split(sizes))
            g = Group(keys, [v.shape for v in views], buffer.dtype, lambda views=views: views,
                      buffer if in_buffer else None, views if in_buffer else None)
            trips.append(r.start(g, group.endpoint(w)))
            buffers.append(buffer)
        means = [r.finish(t, t.pending.wait()) for r, t in zip(rs, trips)]
        return trips, means, buffers, rs

    trips, means, buffers, rs = run(True)
    ref_trips, ref_means, _, ref_rs = run(False)
    assert all(t.in_place for t in trips) and not any(t.in_place for t in ref_trips)
    assert trips[0].payloads[1].values.dtype == (torch.float16 if spec == "gsb" else torch.bfloat16)
    for w in range(n):
        assert all(torch.equal(a, b) for a, b in zip(means[w], ref_means[w]))
        assert torch.equal(buffers[w], torch.cat(ref_means[0]))  # every worker's bucket holds the mean
    fields, ref = rs[0].close_step()[1].fields(), ref_rs[0].close_step()[1].fields()
    assert fields["bytes_per_worker"] == ref["bytes_per_worker"] == 2 * sum(sizes)  # (2-byte values)
    assert fields["density"] == ref["density"] == 1.0
