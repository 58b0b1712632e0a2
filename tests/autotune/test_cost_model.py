"""The analytic cost model (prefixattn.autotune.cost_model): what it counts."""

from prefixattn.autotune import cost_model
from prefixattn.autotune.targets import TARGETS


def test_cost_model_counts_dependent_round_trips():
    sm90, mi300 = TARGETS["sm90"], TARGETS["gfx942"]
    # What compile-check reads from the compiled loops: sm_90 num_stages 3 -> 2 tiles in flight; gfx942's stream
    # pipeliner at num_stages 2 -> one LDS tile + one prefetched through registers.
    assert cost_model.tiles_in_flight(3, sm90) == 2 and cost_model.tiles_in_flight(1, sm90) == 1
    assert cost_model.tiles_in_flight(2, mi300) == 2
    # A 2,048-token prefix: 128 round trips with 16-key tiles one at a time, 16 with 64-key tiles two at a time.
    assert cost_model.round_trips(2048 // 16, 1) == 128 and cost_model.round_trips(2048 // 64, 2) == 16
    assert cost_model.round_trips(0, 2) == 0
