"""bench/gpu_check/hbm_bytes.py: Nsight Compute's CSV rows are attributed to the provider runs the markers announce (the
counters themselves only a GPU reads)."""

import pytest

from gpu_check import hbm_bytes

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"')


def _kernel(i, name, read, write, ns):
    return (f'"{i}","7","python3","localhost","{name}","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","{read}",'
            f'"{write}","{ns}"')


def test_rows_between_markers_belong_to_the_announced_run_with_units_scaled():
    text = "\n".join(["==PROF== Connected to process 7", HEADER,
                      '"","","","","","","","","","","","Mbyte","Kbyte","usecond"',
                      _kernel(0, "prefixattn_ncu_marker", "0", "0", "1"),
                      _kernel(1, "prefix_attention_kernel", "1,024.5", "2", "10"),
                      _kernel(2, "prefix_attention_kernel", "1", "0", "5"),
                      _kernel(3, "prefixattn_ncu_marker", "0", "0", "1"),
                      _kernel(4, "BatchPrefillWithPagedKVCacheKernel", "n/a", "1", "3")])
    kernels = hbm_bytes.parse_ncu_csv(text)
    assert [k["name"] for k in kernels][:2] == ["prefixattn_ncu_marker", "prefix_attention_kernel"]
    assert kernels[1]["dram__bytes_read.sum"] == pytest.approx(1024.5e6)
    assert kernels[1]["gpu__time_duration.sum"] == pytest.approx(10e-6)
    got = hbm_bytes.attribute(kernels, [("s", "prefixattn"), ("s", "flashinfer-prefill-fa2")])
    # The second run's counter was not read ("n/a"): no number rather than a partial sum.
    assert list(got) == [("s", "prefixattn")]
    assert got["s", "prefixattn"]["read"] == pytest.approx(1025.5e6)
    assert got["s", "prefixattn"]["write"] == pytest.approx(2e3) and got["s", "prefixattn"]["kernels"] == 2
    with pytest.raises(ValueError, match="expected 3 markers"):
        hbm_bytes.attribute(kernels, [("s", "a"), ("s", "b"), ("s", "c")])


def test_base_units_without_a_units_row():
    kernels = hbm_bytes.parse_ncu_csv("\n".join([HEADER, _kernel(0, "k", "5", "6", "7")]))
    assert (kernels[0]["dram__bytes_read.sum"], kernels[0]["dram__bytes_write.sum"]) == (5.0, 6.0)
