"""Speculative decoding: draft k tokens cheaply, verify them in one target pass, keep the output
exactly what the target alone would produce.

Pieces (each independent of the scheduler and runner):
- config.SpeculativeConfig: `--speculative-config` JSON as vLLM spells it.
- ngram.NgramProposer: prompt lookup over a request's own verified tokens, indexed incrementally.
- mtp.MultiTokenPredictor: DeepSeek-V3 / GLM next-n prediction layers sharing the target's
  embedding and LM head; mtp.load_mtp_head reads a trained head (heads/*.safetensors).
- mtp_eval: per-position acceptance of an MTP head, measured offline with inference's chaining.
- rejection.greedy_verify / rejection_sample: the lossless acceptance rules over a batch.
- metrics.SpecDecodingProm: vLLM's spec_decode counters; SpecDecodingStats for the log line.

Wiring plan (scheduler, runner, core):

1. Drafts are not tokens yet. A running request carries `spec_token_ids` (proposed after its
   last step, never in all_token_ids). Drafting happens only for a request whose next step
   samples (its prompt is fully computed), while config.use_speculation(num_running) holds
   (disable_by_batch_size), capped so that drafts never pass max_tokens - 1 more outputs or
   max_model_len. Preemption and abort simply drop them.
2. Scheduling: such a request schedules 1 + n tokens (its last verified token and n drafts);
   drafts count against max_num_batched_tokens and are trimmed first when it runs out, and
   allocate_slots(request, 1 + n) gives them KV slots like any token. ScheduledRequest gains
   the draft list; a prefill chunk never carries drafts, so chunked prefill is unchanged.
3. Runner: input ids are the verified token followed by the drafts at consecutive positions;
   logits are taken at all 1 + n rows of a drafting request. Greedy rows go through
   greedy_verify; sampled rows through rejection_sample with the sampler's processed
   probabilities (temperature, top-k/p, min-p, blocked ids applied per position) and
   draft_probs=None for deterministic drafters (n-gram, argmax MTP drafts). A request with its
   own seed verifies alone with its generator. The runner returns a + 1 tokens per request.
4. Rollback: after the pass, num_computed_tokens advances by 1 + a (the verified token and the
   accepted drafts), not by 1 + n; the KV written at the n - a rejected positions stays in
   slots past num_computed_tokens, where the next step overwrites it. Because cache_blocks is
   called with that rolled-back count, and block hashes are computed from all_token_ids
   (verified tokens only), a block holding a rejected draft is never hashed, cached, offloaded
   to a tier, or announced in a KV event.
5. Core: the a + 1 tokens are appended one at a time through the existing stop checks (EOS,
   stop ids and strings, max_tokens, min_tokens); anything after a stop is discarded, so
   outputs, finish reasons and `usage` are what one-token steps give. Logprobs come from the
   target's logits at each emitted position. metrics record (n, a) per drafting request.
6. Proposers run after the step: ngram from all_token_ids (the index reads only the new tail);
   MTP on the runner, since it needs the target's hidden states. The MTP layers own KV caches
   shaped like one target layer each, indexed by the request's block table and slots (so KV
   memory per block grows by num_nextn_predict_layers / num_hidden_layers). Depth 1 runs over
   the step's verified rows only (the token after each row, the target's hidden state there);
   depths 2..k run as decode rows at the following positions and write into the lookahead
   slots that the next step's drafts occupy; depth 1 overwrites them with the target's hidden
   states once those tokens are verified.
7. P/D: the prefill engine never drafts; the decode engine starts drafting after the import,
   its n-gram index built from the request's tokens on first use. Tier loads need nothing new.
"""
