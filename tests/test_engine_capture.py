"""validate/engine_capture.capture_args: the lengths a CUDA graph is planned and captured with in the timing."""
import torch

from attnsel.validate.engine_capture import capture_args


def test_capture_lengths_never_pass_the_real_ones():
    """The plan and the warm-up before capture run on the dummy lengths over the bucket's own page table, which holds
    pages for the real tokens only: a dummy longer than its row reads table entries (and cache slots) the batch does
    not own. An extend row may have more queries than keys (its first queries see no key and give zeros): its dummy
    is its real length, and a row of no keys stays 0 whatever its queries."""
    cu_q = torch.tensor([0, 3, 5, 5, 9], dtype=torch.int32)  # 3, 2, 0 and 4 queries
    lens = torch.tensor([2, 0, 7, 40], dtype=torch.int32)
    args, fill = capture_args("extend", (cu_q, torch.zeros(4, 3, dtype=torch.int32), lens, 4, 40))
    dummy = args[2]
    assert dummy.tolist() == [2, 0, 1, 4], dummy.tolist()
    assert bool((dummy <= lens).all())
    fill()
    assert dummy.tolist() == lens.tolist()
    args, fill = capture_args("decode", (torch.zeros(3, 2, dtype=torch.int32), torch.tensor([0, 5, 1])))
    assert args[1].tolist() == [0, 1, 1]
