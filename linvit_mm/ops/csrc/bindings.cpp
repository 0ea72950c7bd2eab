// Python bindings of linvit_mm's CPU kernels (built by linvit_mm/ops/extension.py).
#include <torch/extension.h>

namespace linvit_mm {
at::Tensor depthwise3x3(const at::Tensor& input, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias, bool residual, int64_t H, int64_t W,
                        bool flip);
at::Tensor correlate3x3(const at::Tensor& a, const at::Tensor& g, int64_t H, int64_t W);
std::vector<at::Tensor> ttt_inner_forward(const at::Tensor& qkv, const at::Tensor& w1,
                                          const at::Tensor& w2, const at::Tensor& w3,
                                          int64_t heads, int64_t num_extra, int64_t H, int64_t W,
                                          double inner_scale);
std::vector<at::Tensor> ttt_inner_backward(const at::Tensor& grad_out,
                                           const std::vector<at::Tensor>& saved,
                                           const at::Tensor& qkv, int64_t heads,
                                           int64_t num_extra, int64_t H, int64_t W,
                                           double inner_scale);
std::vector<at::Tensor> mhla_forward(const at::Tensor& qk, const at::Tensor& v,
                                     const at::Tensor& mixing, const at::Tensor& conv_weight,
                                     const c10::optional<at::Tensor>& conv_bias, int64_t heads,
                                     int64_t H, int64_t W, int64_t rows, int64_t cols,
                                     int64_t block_h, int64_t block_w, double floor,
                                     double eps, bool official);
std::vector<at::Tensor> mhla_backward(const at::Tensor& grad_out,
                                      const std::vector<at::Tensor>& saved,
                                      const at::Tensor& qk, const at::Tensor& v,
                                      const at::Tensor& mixing, int64_t heads, int64_t H,
                                      int64_t W, int64_t rows, int64_t cols, int64_t block_h,
                                      int64_t block_w, bool official);
std::vector<at::Tensor> hedgehog_forward(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& map_q,
                                         const at::Tensor& map_k, bool softmax_map);
std::vector<at::Tensor> hedgehog_backward(const at::Tensor& grad_out,
                                          const std::vector<at::Tensor>& saved,
                                          const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const at::Tensor& map_q,
                                          const at::Tensor& map_k, bool softmax_map);
}  // namespace linvit_mm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace linvit_mm;
  m.def("depthwise3x3", &depthwise3x3,
        "3x3 depthwise convolution of (B, H*W, C) tokens, plus bias and the input if asked",
        py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("residual"), py::arg("H"),
        py::arg("W"), py::arg("flip"));
  m.def("correlate3x3", &correlate3x3, "3x3 depthwise kernel correlation of two token grids",
        py::arg("a"), py::arg("g"), py::arg("H"), py::arg("W"));
  m.def("ttt_inner_forward", &ttt_inner_forward,
        "ViT^3 inner step: [readouts, then the tensors ttt_inner_backward needs]", py::arg("qkv"),
        py::arg("w1"), py::arg("w2"), py::arg("w3"), py::arg("heads"), py::arg("num_extra"),
        py::arg("H"), py::arg("W"), py::arg("inner_scale"));
  m.def("ttt_inner_backward", &ttt_inner_backward,
        "gradients of ttt_inner_forward: [qkv, w1, w2, w3]", py::arg("grad_out"),
        py::arg("saved"), py::arg("qkv"), py::arg("heads"), py::arg("num_extra"), py::arg("H"),
        py::arg("W"), py::arg("inner_scale"));
  m.def("mhla_forward", &mhla_forward,
        "MHLA attention plus its value convolution: [out, then what mhla_backward needs]",
        py::arg("qk"), py::arg("v"), py::arg("mixing"), py::arg("conv_weight"),
        py::arg("conv_bias"), py::arg("heads"), py::arg("H"), py::arg("W"), py::arg("rows"),
        py::arg("cols"), py::arg("block_h"), py::arg("block_w"), py::arg("floor"),
        py::arg("eps"), py::arg("official"));
  m.def("mhla_backward", &mhla_backward,
        "gradients of mhla_forward: [qk, v, mixing, conv_weight, conv_bias]",
        py::arg("grad_out"), py::arg("saved"), py::arg("qk"), py::arg("v"), py::arg("mixing"),
        py::arg("heads"), py::arg("H"), py::arg("W"), py::arg("rows"), py::arg("cols"),
        py::arg("block_h"), py::arg("block_w"), py::arg("official"));
  m.def("hedgehog_forward", &hedgehog_forward,
        "Hedgehog attention's fast form: [out, then what hedgehog_backward needs]",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("map_q"), py::arg("map_k"),
        py::arg("softmax_map"));
  m.def("hedgehog_backward", &hedgehog_backward,
        "gradients of hedgehog_forward: [q, k, v, map_q, map_k]", py::arg("grad_out"),
        py::arg("saved"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("map_q"),
        py::arg("map_k"), py::arg("softmax_map"));
}
