"""PopART's reserved tensor-name prefixes (``willow/include/popart/tensornames.hpp``).

Every ``reserved*Prefix()`` function returns the prefix PopART puts on the tensors it creates
(gradients, optimizer state, optimizer hyper-parameters, ...). The values are PopART's, so
tensor ids a program builds from them (``popart.reservedGradientPrefix() + "w"``) name the
same tensors here.
"""
from __future__ import annotations

from typing import Callable

# name (without "reserved" / "Prefix") -> value; PopART's header order.
PREFIXES: dict[str, str] = {
    # optimizer
    "LossScaling": "lossScaling_",
    "AutomaticLossScale": "AutomaticLossScaleProxy___",
    # SGD0 / SGD1 / SGD2
    "DefaultScaledLearningRate0": "scaledLearningRate0___default___",
    "SpecificScaledLearningRate0": "scaledLearningRate0___specific___",
    "DefaultWeightDecayScaleFactor0": "weightDecayScaleFactor0___default___",
    "SpecificWeightDecayScaleFactor0": "weightDecayScaleFactor0___specific___",
    "DefaultScaledLearningRate1": "scaledLearningRate1___default___",
    "SpecificScaledLearningRate1": "scaledLearningRate1___specific___",
    "DefaultScaledWeightDecay1": "scaledWeightDecay1___default___",
    "SpecificScaledWeightDecay1": "scaledWeightDecay1___specific___",
    "DefaultDampeningScaleFactor1": "dampeningScaleFactor1___default___",
    "SpecificDampeningScaleFactor1": "dampeningScaleFactor1___specific___",
    "DefaultScaledMomentum1": "scaledMomentum1___default___",
    "SpecificScaledMomentum1": "scaledMomentum1___specific___",
    "DefaultScaledLearningRate2": "scaledLearningRate2___default___",
    "SpecificScaledLearningRate2": "scaledLearningRate2___specific___",
    "DefaultDampeningScaleFactor2": "dampeningScaleFactor2___default___",
    "SpecificDampeningScaleFactor2": "dampeningScaleFactor2___specific___",
    "DefaultScaledMomentum2": "scaledMomentum2___default___",
    "SpecificScaledMomentum2": "scaledMomentum2___specific___",
    "DefaultSGDWeightDecay": "sgdWeightDecay___default___",
    "SpecificSGDWeightDecay": "sgdWeightDecay___specific___",
    "DefaultSGDMomentum": "sgdMomentum___default___",
    "SpecificSGDMomentum": "sgdMomentum___specific___",
    "DefaultNesterovGradScaleFactor1": "nesterovGradScaleFactor1___default___",
    "SpecificNesterovGradScaleFactor1": "nesterovGradScaleFactor1___specific___",
    "DefaultNesterovGradScaleFactor2": "nesterovGradScaleFactor2___default___",
    "SpecificNesterovGradScaleFactor2": "nesterovGradScaleFactor2___specific___",
    "DefaultNesterovDampeningScaleFactor1": "nesterovDampeningScaleFactor1___default___",
    "SpecificNesterovDampeningScaleFactor1": "nesterovDampeningScaleFactor1___specific___",
    "DefaultNesterovDampeningScaleFactor2": "nesterovDampeningScaleFactor2___default___",
    "SpecificNesterovDampeningScaleFactor2": "nesterovDampeningScaleFactor2___specific___",
    # Adam / Lamb
    "DefaultAdamBeta1": "adamBeta1___default___",
    "SpecificAdamBeta1": "adamBeta1___specific___",
    "DefaultAdamBeta2": "adamBeta2___default___",
    "SpecificAdamBeta2": "adamBeta2___specific___",
    "DefaultLearningRate": "learningRate___default___",
    "SpecificLearningRate": "learningRate___specific___",
    "DefaultAdamEps": "adamEps___default___",
    "SpecificAdamEps": "adamEps___specific___",
    "DefaultWeightDecay": "weightDecay___default___",
    "SpecificWeightDecay": "weightDecay___specific___",
    "DefaultAdamGradientScaling": "adamGradientScaling___default___",
    "SpecificAdamGradientScaling": "adamGradientScaling___specific___",
    "DefaultMaxWeightNorm": "maxWeightNorm___default___",
    "SpecificMaxWeightNorm": "maxWeightNorm___specific___",
    # Adaptive
    "DefaultAdaptiveAlpha": "adaptiveAlpha___default___",
    "SpecificAdaptiveAlpha": "adaptiveAlpha___specific___",
    "DefaultAdaptiveEps": "adaptiveEps___default___",
    "SpecificAdaptiveEps": "adaptiveEps___specific___",
    "DefaultAdaptiveGradientScaling": "adaptiveGradientScaling___default___",
    "SpecificAdaptiveGradientScaling": "adaptiveGradientScaling___specific___",
    "DefaultAdaptiveMomentum": "adaptiveMomentum___default___",
    "SpecificAdaptiveMomentum": "adaptiveMomentum___specific___",
    # accumulators and optimizer state
    "Accum": "Accum___",
    "Accl": "Accl___",
    "AcclToReduce": "AcclIntoReduce___",
    "AcclToUpdate": "AcclIntoUpdate___",
    "AcclFinalOut": "AcclOutOfAcclUpdate___",
    "Counter": "Counter___",
    "Accl1": "Accl1___",
    "Accl2": "Accl2___",
    "Accl3": "Accl3___",
    "AdamUpdater": "AdamUpdater___",
    "AdaptiveUpdater": "AdaptiveUpdater___",
    "ConcatInit": "ConcatInit___",
    "ConstValue": "ConstValue___",
    "FinalReducedGrad": "FinalReducedGradient___",
    "GlobalNorm": "GlobalNorm___",
    "Gradient": "Gradient___",
    "Index": "Index___",
    "Init": "Init___",
    "LoopIterator": "Iterator___",
    "LambR1Sq": "LambR1Sq___",
    "LambR2Sq": "LambR2Sq___",
    "LoopCond": "LoopCond___",
    "DefaultLossScaling": "lossScaling___default___",
    "SpecificLossScaling": "lossScaling___specific___",
    "LossScalingRatio": "LossScalingRatio_",
    "PreviousLossScaling": "PreviousLossScaling_",
    "RandomSeed": "randomSeed___",
    "SeedModifier": "randomSeedModifier___",
    "RemoteArg": "RemoteArg___",
    "Restored": "Restored___",
    "Stashed": "Stashed___",
    "Step": "Step___",
    "DefaultStep": "step___default___",
    "SpecificStep": "step___specific___",
    "UpdatedVar": "UpdatedVar___",
}


def _prefix_function(name: str, value: str) -> Callable[[], str]:
    def prefix() -> str:
        return value

    prefix.__name__ = prefix.__qualname__ = f"reserved{name}Prefix"
    prefix.__doc__ = f"PopART's reserved tensor-name prefix {value!r}."
    prefix.__module__ = __name__
    return prefix


__all__: list[str] = []
for _name, _value in PREFIXES.items():
    _fn = _prefix_function(_name, _value)
    globals()[_fn.__name__] = _fn
    __all__.append(_fn.__name__)
del _name, _value, _fn
