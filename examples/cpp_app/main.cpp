// Trains a 2-layer MLP, y = W2 · sigmoid(W1 · x + b1) + b2, through opforge::linear and opforge::sigmoid
// with libtorch's autograd and SGD, on a small generated regression problem. Prints the loss at each step
// and exits 1 if it did not fall.
#include <opforge/opforge.h>
#include <torch/torch.h>

#include <cstdio>

struct Mlp : torch::nn::Module {
  Mlp(int64_t in, int64_t hidden, int64_t out)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, out))) {}

  // torch::nn::Linear holds (and initialises) the parameters; opforge computes the layers.
  torch::Tensor forward(const torch::Tensor& x) {
    const auto h = opforge::sigmoid(opforge::linear(x, fc1->weight, fc1->bias));
    return opforge::linear(h, fc2->weight, fc2->bias);
  }

  torch::nn::Linear fc1, fc2;
};

int main() {
  torch::manual_seed(0);
  const int64_t samples = 512, in = 16, hidden = 64, out = 4, steps = 30;

  // Targets from a fixed random "teacher" function of the inputs.
  const auto x = torch::randn({samples, in});
  const auto teacher = torch::randn({in, out}) / 4;
  const auto y = torch::tanh(torch::matmul(x, teacher)) + 0.1 * torch::sin(3 * x.narrow(1, 0, out));

  Mlp model(in, hidden, out);
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.2).momentum(0.7));

  double first = 0, last = 0;
  for (int64_t step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    const auto loss = torch::mse_loss(model.forward(x), y);
    loss.backward();
    optimizer.step();
    last = loss.item<double>();
    if (step == 0) first = last;
    std::printf("step %2lld  loss %.5f\n", static_cast<long long>(step), last);
  }
  const bool fell = last < 0.5 * first;
  std::printf("loss %.5f -> %.5f: %s\n", first, last, fell ? "falling, OK" : "NOT FALLING");
  return fell ? 0 : 1;
}
