"""The supported megatron-core range at import, both sides of each boundary: older releases
refused naming the range, newer ones warned once (rank 0) with the check to run, and their new
TransformerConfig fields refused when set."""

import warnings

import pytest

from megatron_siamese import versions


@pytest.mark.parametrize("text,expected", [("0.16.1", (0, 16, 1)), ("0.19.2rc1", (0, 19, 2)),
                                           ("0.18.2+local", (0, 18, 2)), ("1.0", (1, 0, 0))])
def test_release_reads_the_numeric_version(text, expected):
    assert versions.release(text) == expected


@pytest.mark.parametrize("found,refused,warned", [("0.16.0", True, False), ("0.16.1", False, False),
                                                  ("0.19.2", False, False), ("0.20.0rc0", False, True),
                                                  ("0.20.0", False, True), ("1.0.0", False, True)])
def test_older_releases_are_refused_and_newer_ones_warned(found, refused, warned):
    assert (versions.unsupported_reason(found) is not None) == refused
    assert (versions.untested_notice(found) is not None) == warned


@pytest.fixture
def installed(monkeypatch):
    """Pretend ``found`` is installed, no variable set, on rank 0 of no launcher."""
    for name in (versions.UNTESTED_ENV, "RANK"):
        monkeypatch.delenv(name, raising=False)
    return lambda found: monkeypatch.setattr(versions, "installed_megatron_core", lambda: found)


def test_an_older_release_fails_at_import_naming_the_range(installed, monkeypatch):
    installed("0.15.3")
    with pytest.raises(ImportError, match=r">= 0\.16\.1, < 0\.20.*0\.15\.3 is installed.*MEGATRON_SIAMESE_UNTESTED_MEGATRON=1"):
        versions.check_megatron_core()
    monkeypatch.setenv(versions.UNTESTED_ENV, "1")  # the user's own risk: a warning instead
    with pytest.warns(UserWarning, match="0.15.3 is installed"):
        versions.check_megatron_core()


def test_a_newer_release_warns_on_rank_zero_naming_the_check(installed, monkeypatch):
    installed("0.20.0")
    with pytest.warns(UserWarning, match=r"0\.20\.0 is newer than .* Run `megatron-siamese check --layouts all`") as caught:
        versions.check_megatron_core()
    assert len(caught) == 1
    for name, value in (("RANK", "3"), (versions.UNTESTED_ENV, "1")):
        with monkeypatch.context() as context, warnings.catch_warnings():
            context.setenv(name, value)
            warnings.simplefilter("error")  # any warning fails
            versions.check_megatron_core()


def test_the_installed_release_is_supported_and_tested():
    found = versions.installed_megatron_core()
    assert versions.unsupported_reason(found) is None and versions.untested_notice(found) is None


def test_a_field_outside_the_reviewed_table_is_refused_when_set(megatron_single_rank, monkeypatch):
    """As a newer release's new field meets it: here a known field taken out of the reviewed set."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_siamese import reviewed_settings
    from megatron_siamese.support import UnsupportedConfigError, check_supported

    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
    monkeypatch.setattr(reviewed_settings, "REVIEWED", reviewed_settings.REVIEWED - {"hidden_dropout"})
    check_supported(TransformerConfig(**shape, hidden_dropout=0.1))  # 0.1 is the field's default
    with pytest.raises(UnsupportedConfigError, match=(
            r"cannot build this layer:\n- hidden_dropout=0\.2: megatron-core \S+ added this TransformerConfig field, "
            r"and SiameseNorm has not been checked against it .* leave it at its default 0\.1, or use a tested release")):
        check_supported(TransformerConfig(**shape, hidden_dropout=0.2))
    monkeypatch.setattr(reviewed_settings, "REVIEWED", reviewed_settings.REVIEWED | {"hidden_dropout"})
    check_supported(TransformerConfig(**shape, hidden_dropout=0.2))



@pytest.mark.stack_independent
def test_a_plain_install_has_what_the_default_check_needs():
    """``pip install megatron_siamese`` without extras passes the default ``check`` (issue 49): its
    Megatron-FSDP layouts need einops (Megatron-FSDP builds its device mesh with it), psutil keeps
    torch_dist's checkpoint writers from hanging."""
    import re
    from importlib.metadata import requires

    plain = {re.split(r"[<>=~!; \[]", requirement)[0].lower() for requirement in requires("megatron_siamese")
             if "extra ==" not in requirement}
    assert {"torch", "megatron-core", "einops", "psutil"} <= plain, plain
