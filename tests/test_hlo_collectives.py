"""The HLO collective parser of benchmarks/_common.py on hand-written HLO text.

Every byte number of comm_volume, layout_balance and stale_statistics comes
from `_common.collectives`; here each collective kind, both replica-group
notations, tuple shapes, async starts, conditionals (scoped to the K-FAC
cadence or not) and while loops are checked against bytes worked out by hand
in the comments (ring model per device, g the replica-group size: all-reduce
2(g-1)/g·N, reduce-scatter (g-1)/g·N_in, all-gather and all-to-all
(g-1)/g·N_out, collective-permute N).
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "benchmarks"))
import _common as C  # noqa: E402  pylint: disable=wrong-import-position

ADD = """%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}"""
ALL8 = "replica_groups={{0,1,2,3,4,5,6,7}}"


def module(entry: str, *computations: str) -> str:
  """An HLO module: the `add` reduction, `computations`, then ENTRY %main whose
  body is `entry` (instruction lines)."""
  return "\n\n".join(["HloModule jit_step, entry_computation_layout={()->f32[]}", ADD,
                      *computations,
                      "ENTRY %main.1 (p: f32[1024]) -> f32[] {\n"
                      "  %p = f32[1024]{0} parameter(0)\n" + entry
                      + "\n  ROOT %r = f32[] constant(0)\n}"])


def computation(name: str, body: str) -> str:
  return f"%{name} (x: f32[1024]) -> f32[] {{\n  %x = f32[1024]{{0}} parameter(0)\n{body}\n" \
         "  ROOT %z = f32[] constant(0)\n}"


def one(hlo: str, devices: int = 8) -> C.Collective:
  found, _ = C.collectives(hlo, devices)
  assert len(found) == 1, found
  return found[0]


# ------------------------------------------------------------------- shapes

@pytest.mark.parametrize("shape, expected", [
    ("f32[1024]{0}", 4096),                    # 1024 · 4
    ("bf16[6,2]{1,0}", 24),                    # 12 · 2
    ("f32[]", 4),                              # a scalar
    ("pred[3]", 3),                            # 1 byte each
    ("(f32[10]{0}, s8[4], f64[2,2])", 40 + 4 + 32),
    ("((f32[2]), (u32[], s32[5]))", 8 + 4 + 20),
    ("token[]", 0),                            # no data
])
def test_shape_bytes(shape, expected):
  assert C.shape_bytes(shape) == expected


def test_tuple_elements_top_level_only():
  assert C.tuple_elements("((f32[2]{0}, f32[3]), f32[4,4]{1,0}, u32[])") == [
      "(f32[2]{0}, f32[3])", "f32[4,4]{1,0}", "u32[]"]
  assert C.tuple_elements("f32[8]{0}") == ["f32[8]{0}"]


# ---------------------------------------------------------- collective kinds

def test_all_reduce_explicit_group_of_all():
  c = one(module(f'  %ar = f32[1024]{{0}} all-reduce(f32[1024]{{0}} %p), channel_id=1, '
                 f'{ALL8}, to_apply=%add, metadata={{op_name="jit(step)/psum"}}'))
  assert (c.kind, c.step, c.group, c.name, c.op_name) == (
      "all-reduce", "every", 8, "ar", "jit(step)/psum")
  assert c.payload == 4096
  assert c.ring == 2 * 7 / 8 * 4096              # 7168
  assert not c.in_loop and c.senders is None and not c.fault_check


@pytest.mark.parametrize("groups, g", [
    ("{{0,1},{2,3},{4,5},{6,7}}", 2),            # explicit: 4 groups of 2
    ("{{0,2,4,6},{1,3,5,7}}", 4),
    ("[2,4]<=[8]", 4),                          # iota: 2 groups of 4
    ("[4,2]<=[2,4]T(1,0)", 2),                  # iota, transposed: 4 groups of 2
    ("[1,8]<=[8]", 8),
    ("{}", 8),                                  # empty: every device, one group
])
def test_replica_group_notations(groups, g):
  c = one(module(f"  %ar = f32[1024]{{0}} all-reduce(f32[1024]{{0}} %p), "
                 f"replica_groups={groups}, to_apply=%add"))
  assert c.group == g
  assert c.ring == pytest.approx(2 * (g - 1) / g * 4096)


def test_reduce_scatter_counts_its_input():
  # output f32[128] per device of groups of 8: input 8·128·4 = 4096 B
  c = one(module(f"  %rs = f32[128]{{0}} reduce-scatter(f32[1024]{{0}} %p), {ALL8}, "
                 "dimensions={0}, to_apply=%add"))
  assert (c.kind, c.payload) == ("reduce-scatter", 4096)
  assert c.ring == 7 / 8 * 4096                  # 3584


def test_all_gather_counts_its_output():
  # groups of 4 ([2,4]<=[8]); output f32[4096] = 16384 B
  c = one(module("  %ag = f32[4096]{0} all-gather(f32[1024]{0} %p), "
                 "replica_groups=[2,4]<=[8], dimensions={0}"))
  assert (c.kind, c.group, c.payload) == ("all-gather", 4, 16384)
  assert c.ring == 3 / 4 * 16384                 # 12288


def test_all_to_all_single_and_tuple():
  # f32[64,8] = 2048 B in groups of 4: 3/4 of it leaves the device
  c = one(module("  %a2a = f32[64,8]{1,0} all-to-all(f32[64,8]{1,0} %q), "
                 "replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}"))
  assert (c.kind, c.payload, c.ring) == ("all-to-all", 2048, 1536)
  # tuple form (one buffer per peer): 4 × f32[16] = 256 B
  c = one(module("  %t = (f32[16]{0}, f32[16]{0}, f32[16]{0}, f32[16]{0}) all-to-all("
                 "f32[16]{0} %a, f32[16]{0} %b, f32[16]{0} %c, f32[16]{0} %d), "
                 "replica_groups={{0,1,2,3},{4,5,6,7}}"))
  assert (c.payload, c.ring) == (256, 192)      # 3/4 · 256


def test_tuple_all_reduce_sums_its_buffers():
  # f32[10] + bf16[6,2] = 40 + 24 = 64 B, groups of 8: 2·7/8·64 = 112
  c = one(module(f"  %t = (f32[10]{{0}}, bf16[6,2]{{1,0}}) all-reduce(f32[10]{{0}} %a, "
                 f"bf16[6,2]{{1,0}} %b), {ALL8}, to_apply=%add"))
  assert (c.payload, c.ring) == (64, 112)


def test_collective_permute_senders_and_busiest_device():
  # f32[256] = 1024 B per send; device 0 sends in both permutes
  hlo = module("  %cp1 = f32[256]{0} collective-permute(f32[256]{0} %a), "
               "channel_id=2, source_target_pairs={{0,1},{1,2},{2,3}}\n"
               "  %cp2 = f32[256]{0} collective-permute(f32[256]{0} %b), "
               "source_target_pairs={{0,4}}")
  found, _ = C.collectives(hlo, 8)
  assert [(c.kind, c.payload, c.ring, c.senders) for c in found] == [
      ("collective-permute", 1024, 1024.0, (0, 1, 2)),
      ("collective-permute", 1024, 1024.0, (0,))]
  tot = C.totals(found)["every"]["collective-permute"]
  # ring: the busiest sender, device 0: 1024 + 1024; payload: both buffers
  assert (tot["ring"], tot["payload"], tot["count"]) == (2048, 2048, 2)


def test_async_starts_count_their_result_once():
  # all-gather-start: (operand, result) = (f32[128], f32[1024]) → result 4096 B;
  #   of two operands: ((f32[4], f32[8]), (f32[32], f32[64])) → (32 + 64)·4 = 384 B
  # all-reduce-start of two buffers: its shape is the result, 40 + 8 = 48 B
  # collective-permute-start: (operand, result, contexts) → 512 B
  # reduce-scatter-start: ((operand), result, context) → result f32[16] = 64 B,
  #   so its input is 8 · 64 = 512 B
  # The -done ops carry no traffic of their own.
  hlo = module(
      f"  %ags = (f32[128]{{0}}, f32[1024]{{0}}) all-gather-start(f32[128]{{0}} %a), {ALL8}, "
      "dimensions={0}\n"
      "  %agd = f32[1024]{0} all-gather-done((f32[128]{0}, f32[1024]{0}) %ags)\n"
      "  %ags2 = ((f32[4]{0}, f32[8]{0}), (f32[32]{0}, f32[64]{0})) all-gather-start("
      f"f32[4]{{0}} %a, f32[8]{{0}} %b), {ALL8}, dimensions={{0}}\n"
      f"  %ars = (f32[10]{{0}}, f32[2]{{0}}) all-reduce-start(f32[10]{{0}} %b, f32[2]{{0}} %c), "
      f"{ALL8}, to_apply=%add\n"
      "  %ard = (f32[10]{0}, f32[2]{0}) all-reduce-done((f32[10]{0}, f32[2]{0}) %ars)\n"
      "  %cps = (f32[128]{0}, f32[128]{0}, u32[], u32[]) collective-permute-start("
      "f32[128]{0} %d), source_target_pairs={{0,1},{1,0}}\n"
      f"  %rss = ((f32[128]{{0}}), f32[16]{{0}}, u32[]) reduce-scatter-start(f32[128]{{0}} %e), "
      f"{ALL8}, dimensions={{0}}, to_apply=%add\n"
      "  %rsd = f32[16]{0} reduce-scatter-done(((f32[128]{0}), f32[16]{0}, u32[]) %rss)")
  found, _ = C.collectives(hlo, 8)
  assert {c.name: (c.kind, c.payload, c.ring) for c in found} == {
      "ags": ("all-gather", 4096, 7 / 8 * 4096),
      "ags2": ("all-gather", 384, 7 / 8 * 384),
      "ars": ("all-reduce", 48, 2 * 7 / 8 * 48),
      "cps": ("collective-permute", 512, 512.0),
      "rss": ("reduce-scatter", 512, 7 / 8 * 512)}


def test_generic_async_wrapper_walked_from_its_start_only():
  wrapped = computation("wrapped_rs", f"  %rs = f32[128]{{0}} reduce-scatter(f32[1024]{{0}} "
                        f"%x), {ALL8}, dimensions={{0}}, to_apply=%add")
  hlo = module("  %s = ((f32[1024]{0}), f32[128]{0}) async-start(f32[1024]{0} %p), "
               "calls=%wrapped_rs\n"
               "  %d = f32[128]{0} async-done(((f32[1024]{0}), f32[128]{0}) %s), "
               "calls=%wrapped_rs", wrapped)
  c = one(hlo)
  assert (c.kind, c.payload) == ("reduce-scatter", 4096)


def test_fusion_and_called_computations_are_walked():
  fused = computation("fused_ar", f"  %ar = f32[256]{{0}} all-reduce(f32[256]{{0}} %x), "
                      f"{ALL8}, to_apply=%add")
  callee = computation("callee", "  %ag = f32[64]{0} all-gather(f32[8]{0} %x), "
                       f"{ALL8}, dimensions={{0}}")
  hlo = module("  %f = f32[] fusion(f32[1024]{0} %p), kind=kLoop, calls=%fused_ar\n"
               "  %c = f32[] call(f32[1024]{0} %p), to_apply=%callee\n"
               "  %c2 = f32[] call(f32[1024]{0} %p), to_apply=%callee",
               fused, callee)
  found, _ = C.collectives(hlo, 8)
  # the callee runs twice: its all-gather counts twice
  assert sorted((c.kind, c.payload) for c in found) == [
      ("all-gather", 256), ("all-gather", 256), ("all-reduce", 1024)]


# ---------------------------------------------------- step attribution

def branch(name: str, body: str = "") -> str:
  return computation(name, body)


def test_scoped_conditionals_run_on_factor_and_inverse_steps():
  # factor update: psum_scatter of f32[1024] (4096 B in) in the true branch;
  # decomposition: all-gather of f32[512] (2048 B out) nested inside it;
  # fault check: a psum of one s32 (4 B) in its own conditional.
  decomp = branch("eig_true", f"  %ag = f32[512]{{0}} all-gather(f32[64]{{0}} %x), {ALL8}, "
                  "dimensions={0}")
  factor = branch("fac_true", f"  %rs = f32[128]{{0}} reduce-scatter(f32[1024]{{0}} %x), "
                  f"{ALL8}, dimensions={{0}}, to_apply=%add\n"
                  "  %c = f32[] conditional(s32[] %i, f32[1024]{0} %x, f32[1024]{0} %x), "
                  "branch_computations={%eig_false, %eig_true}, "
                  'metadata={op_name="jit(step)/kfac_factor_update/kfac_decomposition/cond"}')
  fault = branch("fault_true", f"  %f = s32[] all-reduce(s32[] %x), {ALL8}, to_apply=%add, "
                 'metadata={op_name="jit(step)/kfac_fault_check/psum"}')
  hlo = module(
      "  %c1 = f32[] conditional(s32[] %i, f32[1024]{0} %p, f32[1024]{0} %p), "
      "branch_computations={%fac_false, %fac_true}, "
      'metadata={op_name="jit(step)/kfac_factor_update/cond"}\n'
      "  %c2 = f32[] conditional(pred[] %b, f32[1024]{0} %p, f32[1024]{0} %p), "
      "true_computation=%fault_true, false_computation=%fault_false, "
      'metadata={op_name="jit(step)/kfac_fault_check/cond"}\n'
      f"  %g = f32[1024]{{0}} all-reduce(f32[1024]{{0}} %p), {ALL8}, to_apply=%add",
      branch("fac_false"), factor, branch("eig_false"), decomp, branch("fault_false"),
      fault)
  found, notes = C.collectives(hlo, 8)
  by = {c.name: c for c in found}
  assert {n: c.step for n, c in by.items()} == {
      "rs": "factor", "ag": "inverse", "f": "factor", "g": "every"}
  assert by["f"].fault_check and not by["rs"].fault_check
  assert notes == []
  tot = C.totals(found)
  every = 2 * 7 / 8 * 4096                       # 7168: the gradient all-reduce
  factor_b = 7 / 8 * 4096 + 2 * 7 / 8 * 4        # 3584 + 7: RS and the fault psum
  inverse_b = 7 / 8 * 2048                       # 1792: the eigenbasis all-gather
  assert C.step_bytes(tot, "plain") == every
  assert C.step_bytes(tot, "factor") == every + factor_b
  assert C.step_bytes(tot, "inverse") == every + factor_b + inverse_b
  assert C.step_bytes(tot, "inverse", "payload") == 4096 + 4096 + 4 + 2048
  assert C.fault_bytes(found, "factor") == 2 * 7 / 8 * 4
  assert C.fault_bytes(found, "every") == 0


def test_collectives_in_the_identity_branch_are_noted():
  false = branch("f", f"  %ar = f32[8]{{0}} all-reduce(f32[8]{{0}} %x), {ALL8}, "
                 "to_apply=%add")
  hlo = module("  %c = f32[] conditional(s32[] %i, f32[1024]{0} %p, f32[1024]{0} %p), "
               "branch_computations={%f, %t}, "
               'metadata={op_name="jit(step)/kfac_factor_update/cond"}', false, branch("t"))
  found, notes = C.collectives(hlo, 8)
  assert found == []                              # the false branch is never counted
  assert notes == ["c: collectives in the identity (false) branch of the "
                   "kfac_factor_update conditional"]


def test_unscoped_switch_counts_its_largest_branch_every_step():
  # a lax.switch on the device index: one branch runs every step, so the one
  # with the most ring bytes counts (AR of 64 B → 112 vs 256 B → 448)
  small = branch("b0", f"  %s = f32[16]{{0}} all-reduce(f32[16]{{0}} %x), {ALL8}, "
                 "to_apply=%add")
  large = branch("b1", f"  %l = f32[64]{{0}} all-reduce(f32[64]{{0}} %x), {ALL8}, "
                 "to_apply=%add")
  hlo = module("  %c = f32[] conditional(s32[] %i, f32[1024]{0} %p, f32[1024]{0} %p, "
               "f32[1024]{0} %p), branch_computations={%b0, %b1, %b2}, "
               'metadata={op_name="jit(step)/switch"}', small, large, branch("b2"))
  found, notes = C.collectives(hlo, 8)
  assert [(c.name, c.step, c.ring) for c in found] == [("l", "every", 448)]
  assert notes == ["c: collectives in several branches of jit(step)/switch; counted the "
                   "largest"]


def test_while_loops_mark_their_collectives():
  body = branch("body", f"  %ar = f32[32]{{0}} all-reduce(f32[32]{{0}} %x), {ALL8}, "
                "to_apply=%add")
  cond = ("%cond (x: f32[1024]) -> pred[] {\n  %x = f32[1024]{0} parameter(0)\n"
          "  ROOT %t = pred[] constant(true)\n}")
  hlo = module("  %w = f32[1024]{0} while(f32[1024]{0} %p), condition=%cond, body=%body\n"
               f"  %g = f32[8]{{0}} all-gather(f32[1]{{0}} %q), {ALL8}, dimensions={{0}}",
               body, cond)
  found, notes = C.collectives(hlo, 8)
  assert [(c.name, c.in_loop) for c in found] == [("ar", True), ("g", False)]
  assert notes == ["collectives inside while loops (counted once per step)"]


def test_collectives_on_the_factor_step_inside_a_loop():
  # a scoped conditional inside a while body keeps both marks
  true = branch("t", f"  %rs = f32[4]{{0}} reduce-scatter(f32[32]{{0}} %x), {ALL8}, "
                "dimensions={0}, to_apply=%add")
  body = branch("body", "  %c = f32[] conditional(s32[] %i, f32[1024]{0} %x, "
                "f32[1024]{0} %x), branch_computations={%f, %t}, "
                'metadata={op_name="jit(step)/while/body/kfac_factor_update/cond"}')
  cond = ("%cond (x: f32[1024]) -> pred[] {\n  %x = f32[1024]{0} parameter(0)\n"
          "  ROOT %t = pred[] constant(true)\n}")
  hlo = module("  %w = f32[1024]{0} while(f32[1024]{0} %p), condition=%cond, body=%body",
               true, branch("f"), body, cond)
  c = one(hlo)
  assert (c.step, c.in_loop, c.payload) == ("factor", True, 128)   # 8 · 4 · 4


def test_parse_computations_and_missing_entry():
  comps, entry = C.parse_computations(module("  %q = f32[2]{0} constant({1, 2})"))
  assert entry == "main.1"
  assert set(comps) == {"add", "main.1"}
  assert [name for name, _ in comps["main.1"]] == ["p", "q", "r"]
  with pytest.raises(ValueError, match="no ENTRY"):
    C.parse_computations(ADD)
