"""Structured output: constrain a request's tokens to a JSON schema, a regex, a
list of choices or a grammar (llguidance), and tool calling on top of it.

```
 params.py     StructuredOutputsParams (vLLM's field names), validated on creation
 grammar.py    params -> llguidance grammar text; validation
 matchers.py   GrammarBook: the worker's matchers, masks per step, commits
 fence.py      CommitFence: masks wait for the previous step's commits
 bitmask.py    packed bitmask -> -inf logits (on the device)
```
"""

from laneserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
