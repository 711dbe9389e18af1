"""Weight quantization by plan: RTN, AWQ and GPTQ, INT2..INT8 and two-level scales, one representation for all.

    from workbench.quantize import quantize_model            # load_quantized: workbench.model.load
    qm = quantize_model(lm, QuantPlan.uniform("int4"), method="awq", calibration=calib_set)
    qm.apply_(lm.model); qm.save("out/demo-int4-awq")

Modules: ``qtensor`` (the representation, int4 packing), ``rtn`` (round-to-nearest), ``awq``
(scale and clip search, folding), ``gptq`` (error-compensating rounding), ``model`` (plan application, group-size fallback), ``storage``
(the directory a quantized model is saved as; ``workbench.model.load.load_quantized`` loads it), ``cost`` (perplexity, KL, top-1, size against the unquantized model), ``crosscheck``
(AWQ against autoawq, where it imports).
"""
from .awq import apply_awq_scales_, fold_awq_scales, load_awq_search, save_awq_search, search_awq
from .cost import Baseline, QuantCost, heldout_ids, measure_cost, measure_reference
from .gptq import gptq_quantize_weight, search_gptq
from .model import (CALIBRATED_METHODS, METHODS, LayerQuantizer, LayerQuantReport, QuantizedModel, layer_quantizer,
                    quantize_model, resolve_group_size)
from .qtensor import QuantizedWeight, pack_bits, pack_int4, unpack_bits, unpack_int4
from .rtn import fake_quantize, quantize_weight
from .storage import save_quantized, write_report

__all__ = ["QuantizedWeight", "quantize_weight", "fake_quantize", "pack_int4", "unpack_int4", "pack_bits", "unpack_bits", "quantize_model",
           "QuantizedModel", "LayerQuantReport", "resolve_group_size", "save_quantized",
           "write_report", "search_awq", "fold_awq_scales", "apply_awq_scales_", "save_awq_search", "load_awq_search", "Baseline", "QuantCost",
           "measure_reference", "measure_cost", "heldout_ids",
           "gptq_quantize_weight", "search_gptq", "METHODS", "CALIBRATED_METHODS", "LayerQuantizer", "layer_quantizer"]
