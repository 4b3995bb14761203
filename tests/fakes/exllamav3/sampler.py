"""The wheel's ``exllamav3/generator/sampler/``: ``ComboSampler`` of ``presets.py`` and
``CustomSampler`` with the ``SS_*`` steps of ``custom.py``, recording their arguments."""

from __future__ import annotations

from typing import Any


class ComboSampler:
    """Records the ``ComboSampler`` arguments (``generator/sampler/presets.py``, exact 1.6.5
    parameter list). The fake model is greedy whatever they are."""

    def __init__(
        self,
        rep_p: float = 1.0,
        freq_p: float = 0.0,
        pres_p: float = 0.0,
        rep_sustain_range: int = int(10e7),
        rep_decay_range: int = 0,
        dry_multiplier: float = 0.0,
        dry_base: float = 1.75,
        dry_allowed_length: int = 2,
        dry_range: int = 0,
        dry_sequence_breakers: Any = None,
        temperature: float = 1.0,
        min_p: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        temp_last: bool = False,
        adaptive_target: float = 1.0,
        adaptive_decay: float = 0.9,
        logit_bias: dict[int, float] | None = None,
    ) -> None:
        self.settings = {
            "rep_p": rep_p,
            "freq_p": freq_p,
            "pres_p": pres_p,
            "temperature": temperature,
            "min_p": min_p,
            "top_k": top_k,
            "top_p": top_p,
            "logit_bias": logit_bias,
            "rep_sustain_range": rep_sustain_range,
            "rep_decay_range": rep_decay_range,
            "temp_last": temp_last,
            "dry_multiplier": dry_multiplier,
            "dry_base": dry_base,
            "dry_allowed_length": dry_allowed_length,
            "dry_range": dry_range,
            "dry_sequence_breakers": dry_sequence_breakers,
        }


class _Step:
    """One recorded sampler step of a ``CustomSampler`` stack: its class name and arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.args}"


class SS_LogitBias(_Step):
    pass


class SS_RepP(_Step):
    pass


class SS_PresFreqP(_Step):
    pass


class SS_DRY(_Step):
    """``SS_DRY(dry_multiplier, dry_base, dry_allowed_length, dry_range, dry_sequence_breakers,
    tokenizer)``; asserts as 1.6.5 does (``generator/sampler/custom.py:998-1001``)."""

    def __init__(
        self,
        dry_multiplier: float = 0.0,
        dry_base: float = 1.75,
        dry_allowed_length: int = 2,
        dry_range: int = 0,
        dry_sequence_breakers: Any = None,
        tokenizer: Any = None,
    ) -> None:
        assert dry_multiplier >= 0.0, "dry_multiplier must be non-negative"
        assert dry_allowed_length >= 0, "dry_allowed_length must be non-negative"
        super().__init__(dry_multiplier, dry_base, dry_allowed_length, dry_range, dry_sequence_breakers)


class SS_Temperature(_Step):
    pass


class SS_MinP(_Step):
    pass


class SS_TopK(_Step):
    pass


class SS_TopP(_Step):
    pass


class SS_Sample(_Step):
    pass


class SS_XTC(_Step):
    """``SS_XTC(probability, threshold, protected_token_ids=None, tokenizer=None)``; asserts
    both in [0, 1] as 1.6.5 does (``generator/sampler/custom.py:698-699``)."""

    def __init__(
        self, probability: float, threshold: float, protected_token_ids: Any = None, tokenizer: Any = None
    ):
        assert 0.0 <= probability <= 1.0
        assert 0.0 <= threshold <= 1.0
        super().__init__(probability, threshold, protected_token_ids=protected_token_ids, tokenizer=tokenizer)


class CustomSampler:
    """Records a ``CustomSampler(steps)`` stack (``generator/sampler/custom.py:1140-1144``).
    ``settings`` holds what the fake generator reads: the ``SS_LogitBias`` step's biases."""

    def __init__(self, steps: list[_Step]) -> None:
        self.steps = steps
        bias = next((s.args[0] for s in steps if isinstance(s, SS_LogitBias)), None)
        self.settings: dict[str, Any] = {"logit_bias": bias or None}
