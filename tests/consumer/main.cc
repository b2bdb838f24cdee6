#include <iostream>

#include "mapp/topology/rank_grid.h"

int main() {
  mapp::RankGrid grid(8, /*tp=*/2, /*pp=*/2);
  const auto tp_group = grid.group(5, {mapp::Axis::kTensor});
  std::cout << grid.describe() << "; tp group of rank 5:";
  for (int r : tp_group) std::cout << " " << r;
  std::cout << "\n";
  return (grid.dp() == 2 && tp_group == std::vector<int>{4, 5}) ? 0 : 1;
}
