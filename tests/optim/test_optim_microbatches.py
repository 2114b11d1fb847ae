"""Micro-batch calculator (constant and --rampup-batch-size) against values worked out by hand."""
import pytest

from megatron.core import num_microbatches_calculator as nmc


def test_constant():
    calc = nmc.ConstantNumMicroBatchesCalculator(global_batch_size=32, micro_batch_size=2, data_parallel_size=4)
    assert calc.get() == 4 and calc.get_current_global_batch_size() == 32  # 32 / (2 * 4)
    calc.update(10_000, True)
    assert calc.get() == 4
    with pytest.raises(ValueError, match=r"global batch size \(30\) is not divisible by micro batch size \(2\) "
                                         r"times data parallel size \(4\)"):
        nmc.ConstantNumMicroBatches(30, 2, 4)


def test_rampup_table():
    # --rampup-batch-size 4 4 96, --global-batch-size 16, mbs 2, dp 2: (16 - 4) / 4 = 3 increments,
    # one every 96 / 3 = 32 samples; num micro-batches = gbs / (2 * 2).
    calc = nmc.RampupBatchsizeNumMicroBatches(4, 4, 96, 16, 2, 2)
    table = [
        (0, 4, 1),     # int(0 / 32) = 0 increments
        (31, 4, 1),    # int(31 / 32) = 0
        (32, 8, 2),    # 1 increment
        (64, 12, 3),   # 2
        (95, 12, 3),   # int(95 / 32) = 2
        (96, 16, 4),   # 3 increments: the full batch at exactly 96 samples
        (97, 16, 4),   # past the ramp-up
    ]
    for consumed, gbs, micro in table:
        calc.update(consumed, True)
        assert (calc.get_current_global_batch_size(), calc.get()) == (gbs, micro), consumed


def test_rampup_consistency_and_arguments():
    # mbs 2 x dp 3 = 6; start 6, increment 3: the second batch size (9) does not divide by 6.
    calc = nmc.RampupBatchsizeNumMicroBatches(6, 3, 10, 12, 2, 3)
    with pytest.raises(ValueError, match=r"current global batch size \(9\)"):
        calc.update(5, True)
    calc.update(5, False)
    assert calc.get() == 1  # 9 // 6
    with pytest.raises(ValueError, match="divisible by global batch size increment"):
        nmc.RampupBatchsizeNumMicroBatches(4, 5, 96, 16, 2, 2)
    with pytest.raises(ValueError, match="--rampup-batch-size"):
        nmc.build_num_microbatches_calculator(0, [4, 4], 16, 2, 2)
    same = nmc.RampupBatchsizeNumMicroBatches(16, 4, 96, 16, 2, 2)  # nothing to ramp
    assert same.get() == 4


def test_process_wide_calculator():
    nmc.destroy_num_microbatches_calculator()
    with pytest.raises(RuntimeError, match="not initialized"):
        nmc.get_num_microbatches()
    nmc.init_num_microbatches_calculator(0, [4, 4, 96], 16, 2, 2)
    try:
        assert nmc.get_num_microbatches() == 1 and nmc.get_current_global_batch_size() == 4
        nmc.update_num_microbatches(64)
        assert nmc.get_num_microbatches() == 3 and nmc.get_micro_batch_size() == 2
        with pytest.raises(RuntimeError, match="already initialized"):
            nmc.init_num_microbatches_calculator(0, None, 16, 2, 2)
    finally:
        nmc.destroy_num_microbatches_calculator()
