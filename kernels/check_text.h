// Shapes for the ops' error messages. Numbers go in as std::to_string text, never streamed: on a
// host whose C++ runtime was older than the compiler's, streaming an integer from the extension
// crashed inside the locale, so a bad size brought the process down instead of raising.
#ifndef FUSED_TRIPLET_CHECK_TEXT_H
#define FUSED_TRIPLET_CHECK_TEXT_H

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace fused_triplet {

inline std::string shape_text(const at::Tensor& x) {
  std::string text = "[";
  for (int64_t d = 0; d < x.dim(); ++d) text += (d ? ", " : "") + std::to_string(x.size(d));
  return text + "]";
}

}  // namespace fused_triplet

#endif  // FUSED_TRIPLET_CHECK_TEXT_H
