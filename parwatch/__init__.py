"""parwatch: live bubble, collective and guardrail monitoring for TP+PP training."""

__version__ = "0.1.0"
