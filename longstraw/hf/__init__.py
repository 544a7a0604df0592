"""The bridge to transformers' internals (pinned to 5.24): how to reach a model's parts."""
