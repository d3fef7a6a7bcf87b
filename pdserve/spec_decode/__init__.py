"""Speculative decoding: a drafter proposes tokens, one target forward verifies them.

config/speculative.py (SpeculativeConfig: the ``speculative:`` setting), ngram.py (the prompt-lookup
drafter), drafter.py + draft_model.py + mtp_drafter.py (drafters with weights: a draft checkpoint,
the target checkpoint's MTP module; their KV beside the target's), scheduling.py (the scheduler's
side: how many drafts a row gets, applying a verified step's tokens, rolling back the slots of
rejected drafts; no torch), verify.py (the runner's side: greedy prefix acceptance and rejection
sampling over the target's processed distribution), stats.py (the counters behind the
pdserve:spec_decode_* metrics), kvtransfer/speculative_compat.py (what the P/D handshake compares).
"""
