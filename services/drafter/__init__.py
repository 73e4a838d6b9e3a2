"""Drafter role: hosts draft models (separate small models sharing the target's tokenizer, or
layer-truncated copies of the target), keeps a KV cache per request, proposes token trees and
rolls its cache back to the accepted prefix when told the accepted tokens."""
