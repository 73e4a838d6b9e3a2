"""Router role: runs each request's speculative loop (prefill, draft, submit the tree to the
pool, await the verifier's result, tell the drafters, stream tokens out) until EOS, max tokens
or a stop sequence."""
