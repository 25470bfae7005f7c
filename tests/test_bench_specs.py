"""`attnsel bench --specs` with a bad --page-size names the flag, not an item that names no page size."""
import pytest

from attnsel import cli


def test_a_bad_page_size_flag_is_named_not_the_item(capsys):
    code = cli.main(["bench", "--specs", "32/8,8/1/p1", "--page-size", "0", "--heldout", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "--page-size must be a positive integer, got 0" in err and "item" not in err, err


def test_an_items_own_page_size_is_still_checked(capsys):
    code = cli.main(["bench", "--specs", "32/8/p0"])
    err = capsys.readouterr().err
    assert code == 2 and "--specs item '32/8/p0': page_size must be a positive integer, got 0" in err, err


@pytest.mark.parametrize("item", ["32/8/softcap30", "32/8/w4096", "32/8/window4096", "32/8/sinks",
                                  "32/8/128/fp8", "32/8/kv_fp8_e4m3", "32/8/e5m2"])
def test_a_model_feature_in_a_specs_item_is_refused_as_one(item):
    """A feature --specs does not take is refused naming it as a feature and the flag that benches it."""
    from attnsel.bench_args import parse_specs
    from attnsel.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="model feature.*--softcap"):
        parse_specs(item, None)
