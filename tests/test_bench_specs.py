"""`attnsel bench --specs` with a bad --page-size names the flag, not an item that names no page size."""
from attnsel import cli


def test_a_bad_page_size_flag_is_named_not_the_item(capsys):
    code = cli.main(["bench", "--specs", "32/8,8/1/p1", "--page-size", "0", "--heldout", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "--page-size must be a positive integer, got 0" in err and "item" not in err, err


def test_an_items_own_page_size_is_still_checked(capsys):
    code = cli.main(["bench", "--specs", "32/8/p0"])
    err = capsys.readouterr().err
    assert code == 2 and "--specs item '32/8/p0': page_size must be a positive integer, got 0" in err, err
