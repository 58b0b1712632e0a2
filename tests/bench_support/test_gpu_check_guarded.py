"""A GPU check case that crashes is a failed case with its reason (bench/gpu_check/clock.py's ``guarded``), not the
end of the run: the correctness, sanitizer and plan-ahead steps all go through it."""

from gpu_check import clock, sanitizer


class Rows:
    def __init__(self):
        self.rows = []

    def add(self, benchmark, provider, shape, metric, value, unit):
        self.rows.append((benchmark, provider, shape, metric, value))


def test_guarded_returns_the_result_and_its_seconds():
    result, seconds = clock.guarded(lambda a, b=0: dict(passed=True, total=a + b), 2, b=3)
    assert result == dict(passed=True, total=5) and seconds >= 0.0


def test_guarded_turns_a_crash_into_a_failed_result_with_its_cut_reason():
    def crash():
        raise RuntimeError("x" * 1000)

    result, _ = clock.guarded(crash)
    assert result["passed"] is False
    assert result["error"].startswith("RuntimeError: xxx") and len(result["error"]) == clock.FAILURE_CHARS


def test_a_crashing_sanitizer_case_fails_its_row_and_the_rest_still_run(monkeypatch, capsys):
    ran = []

    def run_case(name, device, gpu):
        ran.append(name)
        if name == sanitizer.CASES[0]:
            raise ValueError("no such kernel")
        return dict(passed=True, max_abs_err=0.0)

    monkeypatch.setattr(sanitizer, "run_case", run_case)
    rows = Rows()
    assert sanitizer.run_all("cpu", False, rows) is False
    assert ran == list(sanitizer.CASES)
    passed = {shape: value for _, _, shape, _, value in rows.rows}
    assert passed[sanitizer.CASES[0]] == 0.0 and all(passed[name] == 1.0 for name in sanitizer.CASES[1:])
    assert f"{sanitizer.CASES[0]}: passed=False ValueError: no such kernel" in capsys.readouterr().out
