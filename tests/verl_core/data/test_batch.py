import torch

from verl_core.data.batch import (Batch, PromptTooLongError, batch_from_parquet_bytes,
                                  batch_to_parquet_bytes, encode_prompts,
                                  truncate_prompt)
from verl_core.models.tokenizer import build_char_tokenizer
import pytest


def _batch(seed=0, with_extras=True):
    g = torch.Generator().manual_seed(seed)
    N, P, T = 6, 5, 4
    plen = torch.tensor([5, 3, 5, 2, 4, 1])
    rlen = torch.tensor([4, 1, 0, 2, 4, 3])
    pmask = (torch.arange(P)[None] >= (P - plen)[:, None]).long()
    rmask = (torch.arange(T)[None] < rlen[:, None]).float()
    pids = torch.randint(4, 90, (N, P), generator=g) * pmask
    rids = torch.randint(4, 90, (N, T), generator=g) * rmask.long()
    lp = -torch.rand(N, T, generator=g) * rmask
    kw = {}
    if with_extras:
        kw = dict(score=torch.rand(N, generator=g), ref_logprobs=-torch.rand(N, T, generator=g) * rmask,
                  advantages=torch.randn(N, T, generator=g) * rmask,
                  returns=torch.randn(N, T, generator=g) * rmask,
                  values=torch.randn(N, T, generator=g) * rmask,
                  sum_pi_squared=torch.rand(N, T, generator=g) * rmask,
                  baseline_score=torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5, 0.5]))
        # a greedy response per prompt, repeated over the prompt's rows (lengths 3, 1, 0 -> T_b = 3)
        blen = torch.tensor([3, 3, 1, 1, 0, 0])
        bmask = (torch.arange(3)[None] < blen[:, None]).float()
        bids = torch.randint(4, 90, (N, 3), generator=g)[[0, 0, 2, 2, 4, 4]] * bmask.long()
        kw.update(baseline_response_ids=bids, baseline_response_mask=bmask)
    return Batch(prompt_ids=pids, prompt_mask=pmask, response_ids=rids, response_mask=rmask,
                 response_logprobs=lp, group=torch.tensor([0, 0, 1, 1, 2, 2]),
                 uid=list("aabbcc"), ground_truth=["1", "1", "2", "2", "3", "3"],
                 data_source=["s"] * N, extra_info=[{"i": i} for i in range(N)],
                 meta={"step": 3, "kl_coef": 0.001}, **kw)


@pytest.mark.parametrize("extras", [True, False])
def test_parquet_round_trip_is_bit_exact(extras):
    b = _batch(with_extras=extras)
    r = batch_from_parquet_bytes(batch_to_parquet_bytes(b))
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "response_logprobs",
                 "group", "score", "ref_logprobs", "advantages", "returns", "values",
                 "sum_pi_squared", "baseline_response_ids", "baseline_response_mask",
                 "baseline_score"):
        a, c = getattr(b, name), getattr(r, name)
        if a is None:
            assert c is None
        else:
            assert torch.equal(a, c), name
    assert (r.uid, r.ground_truth, r.extra_info, r.meta) == (b.uid, b.ground_truth, b.extra_info,
                                                             b.meta)


def test_baseline_columns_round_trip_through_parquet_file(tmp_path):
    # the ReMax and OTB columns survive the phase boundary (parquet on disk), dtypes included
    import pyarrow.parquet as pq

    from verl_core.data.batch import batch_to_table, table_to_batch

    b = _batch()
    pq.write_table(batch_to_table(b), tmp_path / "b.parquet")
    table = pq.read_table(tmp_path / "b.parquet")
    assert table.column("baseline_response_ids").to_pylist()[4] == []  # an empty greedy response
    r = table_to_batch(table)
    assert r.baseline_response_ids.dtype == torch.long and r.baseline_score.dtype == torch.float32
    assert r.baseline_response_mask.dtype == torch.float32 and r.sum_pi_squared.dtype == torch.float32
    for name in ("baseline_response_ids", "baseline_response_mask", "baseline_score",
                 "sum_pi_squared"):
        assert torch.equal(getattr(r, name), getattr(b, name)), name
    s = b.select(torch.tensor([5, 0]))
    assert torch.equal(s.baseline_response_ids, b.baseline_response_ids[[5, 0]])


def test_select_rows():
    b = _batch()
    s = b.select(torch.tensor([4, 1]))
    assert s.uid == ["c", "a"] and torch.equal(s.response_ids, b.response_ids[[4, 1]])


def test_encode_prompts_left_pads_and_rejects_long_prompts():
    tok = build_char_tokenizer()
    ids, mask = encode_prompts(tok, ["1+2=", "10+20="], 16)
    # "<bos>1+2=" is 5 tokens, "<bos>10+20=" is 7: the first is left-padded by 2
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1, 1], [1] * 7]
    assert ids[0, :2].tolist() == [tok.pad_token_id] * 2
    with pytest.raises(PromptTooLongError, match="row 1 has 7 tokens > data.max_prompt_length=6"):
        encode_prompts(tok, ["1+2=", "10+20="], 6)


@pytest.mark.parametrize("how,kept", [("left", list(range(4, 10))), ("right", list(range(6))),
                                      ("middle", [0, 1, 2, 7, 8, 9])])
def test_truncate_prompt_cuts_as_verl_does(how, kept):
    # verl's RLHFDataset: left keeps the last max tokens, right the first, middle max // 2 of the
    # head and the rest from the tail; a prompt that fits is never touched
    assert truncate_prompt(list(range(10)), 6, how) == kept
    assert truncate_prompt(list(range(5)), 6, how) == list(range(5))
    assert truncate_prompt(list(range(7)), 6, "middle") == [0, 1, 2, 4, 5, 6]


def test_encode_prompts_cuts_long_prompts_when_told():
    tok = build_char_tokenizer()
    full, _ = encode_prompts(tok, ["1+2=", "10+20="], 16)
    ids, mask = encode_prompts(tok, ["1+2=", "10+20="], 6, truncation="left")
    # "<bos>10+20=" (7 tokens) loses its first: "10+20=", the question's end kept
    assert ids[1].tolist() == full[1, 1:].tolist() and mask[1].tolist() == [1] * 6
    assert ids[0, 1:].tolist() == full[0, 2:].tolist()  # the short prompt is only re-padded
    with pytest.raises(ValueError, match="does not cut"):
        truncate_prompt(list(range(10)), 6, "error")


def test_batch_object_is_plain_parquet_dictionary_encoded_only_where_strings_repeat():
    # an ordinary parquet file (pandas reads it: inspectable, replayable); the strings a prompt's
    # G rows repeat are dictionary encoded, token and float lists are not (it slowed writes 2x)
    import io

    import pandas as pd
    import pyarrow.parquet as pq

    data = batch_to_parquet_bytes(_batch())
    assert pd.read_parquet(io.BytesIO(data))["uid"].tolist() == list("aabbcc")
    meta = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0)
    dictionary = {meta.column(i).path_in_schema.split(".")[0]
                  for i in range(meta.num_columns)
                  if any("DICTIONARY" in e for e in meta.column(i).encodings)}
    assert dictionary == {"uid", "ground_truth", "data_source", "extra_info"}


def test_a_table_in_chunks_or_with_its_own_token_lengths_decodes_by_its_offsets():
    # table_to_batch reuses the response's slots for the token columns when their offsets match
    # (always, for batches we write); chunked/sliced columns and a column of other lengths (a
    # table edited by hand) must still decode by their own offsets
    import pyarrow as pa

    from verl_core.data.batch import batch_to_table, table_to_batch

    b = _batch()
    t = batch_to_table(b)
    chunked = pa.concat_tables([t.slice(0, 2), t.slice(2, 3), t.slice(5)])
    assert chunked.column("response_ids").num_chunks == 3
    r = table_to_batch(chunked)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "advantages"):
        assert torch.equal(getattr(r, name), getattr(b, name)), name
    own = [[0.5] * (i % 3) for i in range(b.num_rows)]  # lengths 0, 1, 2, 0, 1, 2
    t2 = t.set_column(t.column_names.index("advantages"), "advantages",
                      pa.array(own, pa.list_(pa.float32())))
    adv = table_to_batch(t2).advantages
    assert adv.shape == (b.num_rows, 2)
    assert adv.tolist() == [[0.5] * (i % 3) + [0.0] * (2 - i % 3) for i in range(b.num_rows)]
