// The Python module of the CPU kernels: one extension, one definition per op.

#include <torch/extension.h>

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight);
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& q_pos, const torch::Tensor& rows, double scale);
bool vectorised();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("linear", &linear, "batch-invariant fp32 linear (one fma chain per output element)");
  mod.def("attention", &attention, "batch-invariant causal attention over the slotted K/V layout");
  mod.def("vectorised", &vectorised, "whether the AVX2/FMA path was compiled");
}
