"""Settings that used to start silently wrong or slowly (issue 38, item 8): a resume journal
shorter than the resume window, a ``coalesce_output`` that is no boolean, a ``runtime.cpus``
range of millions of CPUs."""

from __future__ import annotations

import time

import pytest

from duplexrt.config import ConfigError, load_config


def test_a_resume_journal_shorter_than_the_resume_window_is_refused():
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["runtime.resume_window_s=30"])  # the journal keeps its 15 s
    message = str(refused.value)
    assert "runtime.resume_journal_s (15)" in message and "runtime.resume_window_s (30)" in message
    assert load_config(None, ["runtime.resume_window_s=30", "runtime.resume_journal_s=30"]).runtime.resume_window_s == 30
    assert load_config(None, ["runtime.resume_window_s=0", "runtime.resume_journal_s=1"])  # no resume: no journal


@pytest.mark.parametrize("value", ['"yes"', "1", "0"])
def test_coalesce_output_must_be_true_or_false(value):
    with pytest.raises(ConfigError, match="runtime.coalesce_output must be true or false"):
        load_config(None, [f"runtime.coalesce_output={value}"])
    assert load_config(None, ["runtime.coalesce_output=false"]).runtime.coalesce_output is False


@pytest.mark.parametrize("value", ['"0-99999999"', '"99999999"', '"3-99999999999999"', "[0, 9000]"])
def test_a_huge_cpu_range_is_refused_at_once_in_a_short_message(value):
    started = time.process_time()
    with pytest.raises(ConfigError) as refused:
        load_config(None, [f"runtime.cpus={value}"])
    assert time.process_time() - started < 1.0  # it used to take 25 s (millions of CPUs expanded)
    assert len(str(refused.value)) < 300 and "from 0 to 8191" in str(refused.value)


def test_cpu_lists_and_ranges_still_read():
    assert load_config(None, ['runtime.cpus="4-7,12"']).runtime.cpus == (4, 5, 6, 7, 12)
    assert load_config(None, ["runtime.cpus=[0, 8191]"]).runtime.cpus == (0, 8191)
    assert len(load_config(None, ['runtime.cpus="0-8191"']).runtime.cpus) == 8192
