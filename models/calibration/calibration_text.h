// The calibration text the binaries carry: English prose InfiniGen's skew
// is calibrated on when no --skew file is given (README.md beside this
// file says where it comes from).
#ifndef INFINIGEN_MODELS_CALIBRATION_CALIBRATION_TEXT_H_
#define INFINIGEN_MODELS_CALIBRATION_CALIBRATION_TEXT_H_

namespace infinigen::model {

// About 19 KB of UTF-8 text, NUL-terminated.
extern const char kCalibrationText[];

}  // namespace infinigen::model

#endif  // INFINIGEN_MODELS_CALIBRATION_CALIBRATION_TEXT_H_
